"""A supervised worker's front: the engine as the HTTP side sees it (AsyncEngine's narrow
interface: submit, abort, stats), computed in the slot's core process, over the channel
(core_channel.py). The front keeps every request's state, so that a core can die without
a request failing: its requests go to the slot's next core with the output they had so far,
and the engine goes on from there (Engine.add: the same tokens, greedy or seeded); the
client's stream goes on where it stopped, nothing repeated, nothing missing.

Which core is the slot's: the one that said hello last. A hello says why it came
("takeover"): the slot's first core; the last one died ("died": the supervisor saw it go,
its requests fail over, each counting it); or a rolling restart ("restart": the old core
is retired, nothing counts). Only a hello moves requests (the supervisor, which reaps the
cores, is the one that knows a core died): a core silent for CORE_SILENCE makes /health
say so, and requests that waited CORE_WAIT for a core that never came fail (503).

`preload sleep` kills the slot's cores and tells the front (`sleep`, from the daemon's
link): its requests are held as while a core is replaced, nothing counts as a failover,
and /health says "sleeping". The wake's core says hello as a rolling restart's does and
takes them up where they were; one that waited SLEEP_WAIT asleep fails (503, naming sleep).

A request that kills every core it touches (a poison pill) must not take its neighbours
with it: one that was on SUSPECT_AFTER cores that died runs alone, the others held back,
until it has made CLEAR_TOKENS more tokens or finished; a core that dies with it alone,
its MAX_FAILOVERS-th, fails it alone (500, naming the cause).

Aborts (clients that left) and dispatches wait for the event loop's next turn
(`_kick`): the requests that end together, as a crowd of clients that hang up at once does,
cost the core one abort message and the front one look at its waiting requests, not one
each (500 streams dropped at once: their aborts reach the core in a few messages).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import zmq
import zmq.asyncio

from preload.checkpoint.tokenizer import Tokenizer
from preload.worker.core_channel import decode, encode, output_from_wire, own, params_to_wire, stats_from_wire
from preload.worker.engine.async_engine import EngineDead, RequestFailed, failure
from preload.worker.engine.engine import EngineStats, check_sequence
from preload.worker.engine.faults import SequenceFault
from preload.worker.engine.output import Output
from preload.worker.engine.output_text import OutputText
from preload.worker.engine.sequence import Sequence

log = logging.getLogger("preload.worker")

CORE_SILENCE = 5.0  # seconds without a beat: /health says the engine is not answering
CORE_WAIT = 60.0  # seconds requests wait for a silent core, or its successor, before they fail
SLEEP_WAIT = 60.0  # seconds a request waits while the slot sleeps (for `preload wake`) before it fails
MAX_FAILOVERS = 3
SUSPECT_AFTER = 2
CLEAR_TOKENS = 16
WATCH = 0.1  # seconds between looks at the core's beats


@dataclass(eq=False)
class Request:
    seq: Sequence  # the front's own: prompt, params, and output as far as delivered
    reader: asyncio.Queue
    text: OutputText
    core: bytes | None = None  # the core computing it, if any
    failovers: int = 0  # cores that died while computing it
    cleared: int = 0  # tokens it made since it last ran alone (a suspect is cleared at CLEAR_TOKENS)
    scored: bool = False  # its prompt log-probs were delivered (not asked for again)
    waits: float = field(default_factory=time.monotonic)  # since when it waits, if the slot sleeps

    @property
    def suspect(self) -> bool:
        return self.failovers >= SUSPECT_AFTER and self.cleared < CLEAR_TOKENS


class CoreClient:
    def __init__(self, address: str):
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a core that is gone fails, not vanishes
        self.sock.setsockopt(zmq.MAXMSGSIZE, -1)
        path = Path(address.removeprefix("ipc://"))
        path.unlink(missing_ok=True)  # a dead front's (the state dir is ours)
        old = os.umask(0o177)
        try:
            self.sock.bind(address)
        finally:
            os.umask(old)
        self.requests: dict[int, Request] = {}
        self.core: bytes | None = None  # the slot's core
        self.heard = 0.0  # its last beat
        self.info: dict = {}  # its hello, less the files
        self.tokenizer: Tokenizer | None = None
        # The checkpoint's tokenizer, read from its files while the slot's core started (serve.py):
        # taken for the core's own when its hello carries the same files.
        self.read_ahead: Tokenizer | None = None
        self.hello = asyncio.Event()  # set once a core said hello
        self._stats = EngineStats(0, 0, 0, 1, 0, 0, 0, 0, 0, 0)
        self.on_step: Callable[[], None] = lambda: None  # after each beat (metrics)
        self.ticks = 0  # the event loop's turns through `run`: its liveness, for the daemon
        self.cores_lost = 0
        self.asleep = False  # `preload sleep`: the slot's cores are gone until the wake
        self._tasks: list[asyncio.Task] = []
        self._aborts: dict[bytes, list[int]] = {}  # what `_flush` sends: the ids to abort, by core
        self._dispatching = False  # `_flush` dispatches too
        self._kicked = False  # a `_flush` is scheduled

    # ---- what the HTTP side uses (AsyncEngine's interface) --------------------------------------

    @property
    def alive(self) -> bool:
        """Whether requests are taken: a core has said hello and not been silent for
        CORE_WAIT (dead and not replaced; a replacement's hello takes its requests), or the
        slot sleeps (its requests wait for the wake, up to SLEEP_WAIT each); once woken, its
        core has CORE_WAIT to come."""
        return self.asleep or self.hello.is_set() and time.monotonic() - self.heard < CORE_WAIT

    @property
    def answering(self) -> bool:
        """Whether the slot's core answers now (beats within CORE_SILENCE): /health's word."""
        return self.core is not None and time.monotonic() - self.heard < CORE_SILENCE

    def in_flight(self) -> int:
        return len(self.requests)

    def progress(self) -> tuple[int, bool]:
        return self.ticks, True

    def stats(self) -> EngineStats:
        return self._stats

    def submit(self, seq: Sequence) -> AsyncIterator[Output]:
        check_sequence(seq, int(self.info.get("vocab", 0)), int(self.info.get("max_model_len", 0)))
        return self._outputs(seq)

    def abort(self, seq: Sequence) -> None:
        req = self.requests.pop(seq.id, None)
        if req is not None and req.core is not None:
            self._aborts.setdefault(req.core, []).append(seq.id)
            self._kick()

    def _kick(self, dispatch: bool = False) -> None:
        """`_flush` at the event loop's next turn (at once outside the loop)."""
        self._dispatching = self._dispatching or dispatch
        if self._kicked:
            return
        try:
            asyncio.get_running_loop().call_soon(self._flush)
            self._kicked = True
        except RuntimeError:
            self._flush()

    def _flush(self) -> None:
        """The aborts of this turn, one message to each core; then the waiting requests
        dispatched, if a request came or went."""
        self._kicked = False
        aborts, self._aborts = self._aborts, {}
        for core, ids in aborts.items():
            self._send(core, {"t": "abort", "ids": ids})
        if self._dispatching:
            self._dispatching = False
            self._dispatch()

    async def _outputs(self, seq: Sequence) -> AsyncIterator[Output]:
        req = Request(seq, asyncio.Queue(), OutputText(self.tokenizer, seq.params))
        self.requests[seq.id] = req
        self._kick(dispatch=True)
        finished = False
        try:
            while not finished:
                news = [await req.reader.get()]
                while not req.reader.empty():
                    news.append(req.reader.get_nowait())
                raised = next((n for n in news if isinstance(n, BaseException)), None)
                if raised is not None:  # (not named `failure`: that is the function below)
                    raise raised
                out = Output.merge(news)
                try:
                    out = req.text.add(out)
                except SequenceFault as fault:
                    raise RequestFailed(str(fault)) from None
                if out.error is not None:
                    raise failure(out)
                finished = out.finished
                yield out
        finally:
            if self.requests.get(seq.id) is req:  # (its reader left, or a stop string ended it: not its core)
                self.abort(seq)
            self._kick(dispatch=True)  # (a suspect's end lets the others go)

    # ---- the channel ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Read the cores, and watch their beats, until cancelled."""
        self._tasks = [asyncio.ensure_future(self._watch())]
        try:
            while True:
                frames = await self.sock.recv_multipart(copy=False)
                self.ticks += 1
                if len(frames) != 2 or not own(frames[1]):
                    log.warning("a message not from a core of our uid: dropped")
                    continue
                identity = frames[0].bytes
                try:
                    msg = decode(frames[1].bytes)
                    getattr(self, f"_on_{msg['t']}")(identity, msg)
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    log.warning("a malformed message from %s (%s): dropped", identity, e)
        finally:
            for t in self._tasks:
                t.cancel()

    def close(self) -> None:
        self.sock.close(linger=0)

    def _send(self, core: bytes, msg: dict) -> None:
        try:
            self.sock.send_multipart([core, encode(msg)], flags=zmq.NOBLOCK).add_done_callback(_quiet)
        except zmq.ZMQError:
            pass  # that core is gone: the beats will say so (or have said)

    def sleep(self, sleeping: bool, level: int | None = None) -> None:
        """The daemon put the slot to sleep (its cores killed) or woke it (its next core's
        hello follows). Asleep, every request waits, none counting a failover."""
        now = time.monotonic()
        if sleeping and not self.asleep:
            log.info("the slot sleeps (level %s): %d requests wait for the wake", level, len(self.requests))
            if self.core is not None:
                self._move_off(self.core, died=False)
            self.core = None
            self._stats = replace(self._stats, waiting=0, running=0, kv_blocks_used=0)  # (nothing runs: /metrics)
            for req in self.requests.values():
                req.waits = now
        elif not sleeping and self.asleep:
            log.info("the slot wakes: %d requests wait for its core", len(self.requests))
            self.heard = now  # (the wake's core has CORE_WAIT to say hello)
        self.asleep = sleeping

    def _on_hello(self, core: bytes, msg: dict) -> None:
        if self.asleep:
            return  # a core the sleep killed, late (the wake's cores come after the daemon's word)
        files = msg.pop("files", None) or {}
        if self.tokenizer is None or files:
            ready, self.read_ahead = self.read_ahead, None
            self.tokenizer = ready if ready is not None and ready.made_of(files) else Tokenizer(
                files["tokenizer.json"], json.loads(files.get("tokenizer_config.json") or "{}"))
        self.info = {k: v for k, v in msg.items() if k != "t"}
        old, self.core, self.heard = self.core, core, time.monotonic()
        self._send(core, {"t": "welcome", "front": os.getpid(), "hello": False})
        if old is not None and old != core:
            died = msg.get("takeover") == "died"
            log.info("core %s takes over from %s (%s)", core.decode(), old.decode(), "it died" if died else "restart")
            self._move_off(old, died)
            self._send(old, {"t": "retire"})
        self.hello.set()
        self._dispatch()

    def _on_beat(self, core: bytes, msg: dict) -> None:
        if core == self.core:
            self.heard = time.monotonic()
            self._stats = stats_from_wire(msg["stats"])
            self.on_step()
        elif self.asleep:
            pass  # a core the sleep kills: no hello from it
        elif self.core is None:  # a core from before this front (which restarted): its hello, please
            self._send(core, {"t": "welcome", "front": os.getpid(), "hello": True})
        else:
            self._send(core, {"t": "retire"})  # a core the slot has moved on from

    def _on_out(self, core: bytes, msg: dict) -> None:
        landed = time.monotonic()
        for wire in msg["o"]:
            out = output_from_wire(wire)
            out.land(landed)
            req = self.requests.get(out.seq_id)
            if req is None or req.core != core:
                continue  # (its reader left, or another core computes it now)
            seq = req.seq
            if out.prompt_logprobs is not None:
                if req.scored:
                    out.prompt_logprobs = out.prompt_ranks = out.prompt_top_logprobs = None
                req.scored = True
            seq.output.extend(out.token_ids)
            req.cleared += len(out.token_ids)
            if out.finished:  # done: its reader has what it needs. Kept until read, a finished request
                # looked like one waiting for a core, and the next hello or dispatch sent it again
                # (a rolling restart's core computed one token past max_tokens, delivered with the last).
                self.requests.pop(out.seq_id, None)
            req.reader.put_nowait(out)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH)
            self.ticks += 1
            now = time.monotonic()
            if self.asleep:
                for req in [r for r in self.requests.values() if now - r.waits >= SLEEP_WAIT]:
                    self.requests.pop(req.seq.id, None)
                    req.reader.put_nowait(EngineDead(f"the model is asleep (preload sleep) and was not woken within"
                                                     f" {SLEEP_WAIT:.0f} s; `preload wake` brings it back"))
            elif self.requests and self.hello.is_set() and not self.alive:
                log.error("no core has answered for %.0f s: its requests fail", now - self.heard)
                for req in list(self.requests.values()):
                    self.requests.pop(req.seq.id, None)
                    req.reader.put_nowait(EngineDead(f"the engine stopped answering {CORE_WAIT:.0f} s ago"))

    def _move_off(self, core: bytes, died: bool) -> None:
        """Every request `core` computed waits for the next core; with `died`, each counts
        the death, and one alone on it (a suspect, run so) fails at its MAX_FAILOVERS-th."""
        self.cores_lost += died
        on_it = [req for req in self.requests.values() if req.core == core]
        for req in on_it:
            req.core = None
            if not died:
                continue
            req.failovers += 1
            req.cleared = 0
            if len(on_it) == 1 and req.failovers >= MAX_FAILOVERS:
                self.requests.pop(req.seq.id, None)
                req.reader.put_nowait(RequestFailed(
                    f"the engine died {req.failovers} times while computing this request, the last time with this"
                    " request alone: it is not tried again"))

    def _dispatch(self) -> None:
        """Send the waiting requests to the slot's core: all of them, unless a suspect
        waits or runs: then it runs alone, the first suspect first."""
        if self.core is None:
            return
        running = [r for r in self.requests.values() if r.core is not None]
        waiting = [r for r in self.requests.values() if r.core is None]
        suspects = [r for r in self.requests.values() if r.suspect]
        if suspects:
            if running:
                return  # (a suspect runs, or the others finish before one does)
            waiting = suspects[:1]
        for req in waiting:
            self._start(req)

    def _start(self, req: Request) -> None:
        seq = req.seq
        params = replace(seq.params, prompt_logprobs=None) if req.scored else seq.params
        req.core = self.core
        self._send(self.core, {"t": "add", "id": seq.id, "prompt": seq.prompt, "output": list(seq.output),
                               "params": params_to_wire(params)})


def _quiet(future) -> None:
    """(A send that failed: its core is gone, which the beats tell; nothing to log twice.)"""
    if not future.cancelled():
        future.exception()
