"""A supervised worker's engine core: the model on the daemon's weights, the scheduler,
the KV cache and its CUDA graphs, and no HTTP. Its requests come from its slot's front
over the channel (core_channel.py), and their Outputs go back there, a step's in one
message; the front makes their text and answers the clients.

One thread: between steps it reads what the front sent (requests, aborts), and when the
engine has nothing to do it waits on the socket (capturing a lazy start's graphs while
idle). A request arrives with the output its last core gave it, if any: the engine goes
on from there (Engine.add). Beats tell the front the engine's figures (and that the core
lives); a core whose front restarted (a welcome from another pid) drops that front's
requests, which nobody reads any more.

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

import zmq

from preload.worker.core_channel import BEAT, decode, encode, output_to_wire, own, params_from_wire, stats_to_wire
from preload.worker.engine.sampling_params import RequestError
from preload.worker.engine.sequence import Sequence
from preload.worker.llm import LLM

log = logging.getLogger("preload.worker")

SEND_TIMEOUT_MS = 10_000  # a front that reads nothing for this long is gone: its requests are dropped


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
        self.retired = False
        self.drain_until: float | None = None
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
        next_beat = 0.0
        while not self.retired:
            now = time.monotonic()
            if self.drain_until is not None and (not self.seqs or now > self.drain_until):
                break
            if now >= next_beat:
                self._send({"t": "beat", "pid": os.getpid(), "stats": stats_to_wire(self.engine.stats())})
                next_beat = now + BEAT
            busy = self.engine.has_work()
            if self.sock.poll(0 if busy else int(1000 * max(0.0, min(next_beat - now, BEAT)))):
                self._read()
            if self.engine.has_work():
                self._step()
            elif not busy:
                self.engine.capture_idle()  # (idle: the decode graphs a lazy start left, one at a time)
        log.info("core done (%s)", "retired" if self.retired else "drained")

    def _step(self) -> None:
        outputs = self.engine.step()  # (an engine fault goes up: the process exits, and is replaced)
        self.steps += 1
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
        except RequestError as e:  # (checked by the front against this core's limits: should not happen)
            self._send({"t": "out", "o": [[seq.id, [], [], [], None, None, f"refused by the engine: {e}"]]})
            return
        self.seqs[seq.id] = seq

    def _on_abort(self, msg: dict) -> None:
        seq = self.seqs.pop(int(msg["id"]), None)
        if seq is not None:
            self.engine.abort(seq)

    def _on_retire(self, _msg: dict) -> None:
        log.info("retired by the front: %d requests go to another core", len(self.seqs))
        self._abort_all()
        self.retired = True

    def _abort_all(self) -> None:
        for seq in self.seqs.values():
            self.engine.abort(seq)
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
