"""A supervised worker's engine core: the model on the daemon's weights, the scheduler,
the KV cache and its CUDA graphs, and no HTTP. Its requests come from its slot's front
over the channel (core_channel.py), and their Outputs go back there, a step's in one
message; the front makes their text and answers the clients.

One thread: between steps it reads everything the front sent (requests, aborts), and when
the engine has nothing to do it waits on the socket (capturing a lazy start's graphs while
idle). A request arrives with the output its last core gave it, if any: the engine goes
on from there (Engine.add). Beats tell the front the engine's figures (and that the core
lives); a core whose front restarted (a welcome from another pid) drops that front's
requests, which nobody reads any more. A beat goes out early, without waiting for BEAT,
once aborts freed sequences (at most every PROMPT_BEAT) and as soon as the engine runs out
of work, so that the front's figures (/metrics: KV blocks in use) say at once that the
cache of clients who left is free.

On a CPU the model's torch threads leave one CPU to the rest of the worker (`cpu_threads`):
the front, which shares the machine, turns disconnects into aborts and tokens into text;
torch's default, a thread per core, makes every step wait on a thread the front has
descheduled (a decode step of 256 sequences on 2 cores: 0.07 s alone, 0.65 s with the
other core busy at 2 threads, 0.10 s at 1), and the aborts of clients who left waited on
such a step. Issue 36, 500 streams dropped at once on 2 CPUs (scripts/probe_aborts.py):
freed in 0.5-2.2 s before, median 0.8 s; 0.13-0.66 s since, median 0.25 s; with these
threads alone, or with the batched aborts and early beats alone, 0.34-0.66 s.

It ends when its front retires it (another core has its requests: a rolling restart),
or on SIGTERM once the requests it holds are done (up to the drain timeout), or when the
engine fails: then it exits non-zero, the supervisor replaces it, and the front hands the
requests to the replacement.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch
import zmq

from preload.worker.core_channel import BEAT, decode, encode, output_to_wire, own, params_from_wire, stats_to_wire
from preload.worker.engine.faults import ENGINE_FAULTS
from preload.worker.engine.grammar import GrammarsUnavailable
from preload.worker.engine.output import Output
from preload.worker.engine.sampling_params import RequestError
from preload.worker.engine.sequence import Sequence
from preload.worker.llm import LLM

log = logging.getLogger("preload.worker")

SEND_TIMEOUT_MS = 10_000  # a front that reads nothing for this long is gone: its requests are dropped
PROMPT_BEAT = 0.02  # seconds: the soonest a beat follows the last once aborts freed sequences (or work ran out)
FIRST_STEPS = 4  # a core logs its first steps' times: what its start left to its first requests shows there


def cpu_threads() -> int:
    """The torch threads of a core on a CPU: one fewer than the CPUs this process may use
    (the front's), never more than torch's own default, at least one."""
    return max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)) - 1))


def hello_of(llm: LLM, model_name: str, takeover: str) -> dict:
    """What a core tells its front when it starts serving the slot (core_channel's hello)."""
    return {"pid": os.getpid(), "fingerprint": llm.attached.manifest.fingerprint if llm.attached else "in-process",
            "model": model_name, "vocab": llm.config.vocab_size, "max_model_len": llm.engine.max_model_len,
            "files": llm.tokenizer.files, "takeover": takeover}


class Core:
    def __init__(self, llm: LLM, address: str, hello: dict, drain_timeout: float):
        """`hello`: what the front is told of this core (core_channel's hello, less "t")."""
        self.llm, self.engine, self.hello_fields = llm, llm.engine, hello
        self.drain_timeout = drain_timeout
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"core-{os.getpid()}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self.sock.connect(address)
        self.seqs: dict[int, Sequence] = {}  # the front's requests, by its ids
        self.front: int | None = None  # the pid of the front they belong to
        self.steps = 0
        self.first_request: float | None = None  # when the first request came (time.monotonic)
        self.retired = False
        self.drain_until: float | None = None
        self.freed = False  # aborts freed sequences since the last beat
        if llm.device.type == "cpu":
            torch.set_num_threads(cpu_threads())
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def progress(self) -> tuple[int, bool]:
        """For the daemon's hang check (worker/link.py): steps so far, whether it has work."""
        return self.steps, bool(self.seqs)

    def _on_sigterm(self, *_) -> None:
        if self.drain_until is None:
            log.info("draining %d requests", len(self.seqs))
            self.drain_until = time.monotonic() + self.drain_timeout

    def run(self) -> None:
        self._send({"t": "hello", **self.hello_fields})
        last_beat, next_beat = 0.0, 0.0
        captured = False  # the last idle turn captured a graph: the next looks for messages without waiting
        while not self.retired:
            now = time.monotonic()
            if self.drain_until is not None and (not self.seqs or now > self.drain_until):
                break
            if now >= next_beat:
                self._send({"t": "beat", "pid": os.getpid(), "stats": stats_to_wire(self.engine.stats())})
                last_beat, next_beat, self.freed = now, now + BEAT, False
            busy = self.engine.has_work()
            if self.sock.poll(0 if busy or captured else int(1000 * max(0.0, min(next_beat - now, BEAT)))):
                self._read()
            captured = False
            if self.engine.has_work():
                self._step()
            elif not busy:  # idle: the graphs a lazy start left, one at a time, back to back (a request waits for one)
                captured = self.engine.capture_idle()
            if self.freed or (busy and not self.engine.has_work()):  # the front hears it now
                next_beat = min(next_beat, last_beat + PROMPT_BEAT)
        log.info("core done (%s)", "retired" if self.retired else "drained")

    def _step(self) -> None:
        t = time.monotonic()
        outputs = self.engine.step()  # (an engine fault goes up: the process exits, and is replaced)
        self.steps += 1
        if self.steps <= FIRST_STEPS:  # (kernels met first, graphs captured at first use, a capture waited for)
            log.info("step %d (%s) in %.3f s, begun %.3f s after the first request came", self.steps,
                     self.engine.clock.kind, time.monotonic() - t, t - (self.first_request or t))
        for out in outputs:
            if out.finished:
                self.seqs.pop(out.seq_id, None)
        if outputs:
            self._send({"t": "out", "o": [output_to_wire(o) for o in outputs]})

    def _read(self) -> None:
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if not own(frame):
                log.warning("a message from uid other than ours: dropped")
                continue
            try:
                msg = decode(frame.bytes)
                getattr(self, f"_on_{msg['t']}")(msg)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                log.warning("a malformed message from the front (%s): dropped", e)

    def _on_welcome(self, msg: dict) -> None:
        front = int(msg["front"])
        if self.front is not None and front != self.front:  # the front restarted: nobody reads these any more
            log.warning("a new front (pid %d): dropping the %d requests of pid %d", front, len(self.seqs), self.front)
            self._abort_all()
        self.front = front
        if msg.get("hello"):
            self._send({"t": "hello", **self.hello_fields})

    def _on_add(self, msg: dict) -> None:
        seq = Sequence(list(msg["prompt"]), params_from_wire(msg["params"]), id=int(msg["id"]),
                       output=list(msg["output"]))
        try:
            self.engine.check(seq)
            self.engine.add(seq)
        except RequestError as e:  # (the front checked this core's limits; a grammar refusing the output handed
            # over, which its last core drew under that grammar: not the client's fault, a 500 with the reason;
            # a grammar this model's tokenizer cannot serve: a 400)
            self._refuse(seq, f"refused by the engine: {e}", isinstance(e, GrammarsUnavailable))
            return
        except ENGINE_FAULTS:
            raise
        except Exception as e:  # noqa: BLE001 - a well-formed request the engine could not take: answered, not dropped
            log.exception("request %d not taken", seq.id)
            self._refuse(seq, f"the engine could not take this request: {type(e).__name__}: {e}", False)
            return
        self.seqs[seq.id] = seq
        if self.first_request is None:
            self.first_request = time.monotonic()

    def _refuse(self, seq: Sequence, error: str, refused: bool) -> None:
        """Answer `seq`, not taken, with `error` (`refused`: the request's own fault, a 400)."""
        self._send({"t": "out", "o": [output_to_wire(Output(seq.id, error=error, refused=refused))]})

    def _on_abort(self, msg: dict) -> None:
        """One request's abort ("id") or, as the front sends them, those of one turn of its
        event loop ("ids")."""
        ids = msg["ids"] if "ids" in msg else [msg["id"]]
        for i in ids:
            seq = self.seqs.pop(int(i), None)
            if seq is not None:
                self.engine.abort(seq)
                self.freed = True

    def _on_retire(self, _msg: dict) -> None:
        log.info("retired by the front: %d requests go to another core", len(self.seqs))
        self._abort_all()
        self.retired = True

    def _abort_all(self) -> None:
        for seq in self.seqs.values():
            self.engine.abort(seq)
        self.freed = self.freed or bool(self.seqs)
        self.seqs.clear()

    def _send(self, msg: dict) -> None:
        try:
            self.sock.send(encode(msg))
        except zmq.Again:
            log.warning("the front has read nothing for %d s: its requests are dropped", SEND_TIMEOUT_MS // 1000)
            self._abort_all()

    def close(self) -> None:
        self._abort_all()
        self.sock.close(linger=0)
