"""The engine on its own thread, fed by asyncio: HTTP handlers never wait on a model step.

What handlers use is narrow: `submit` a sequence and read its Outputs, `abort` it,
read `stats`. Sequences and aborts are queued to the engine thread; after each step it
hands that step's Outputs (tokens) to the event loop in one call, and each goes to the
queue of the request it belongs to, whose reader makes their text (output_text.py) on
the event loop, off the engine's thread.

A failure inside `Engine.step` that is one sequence's own comes back as that sequence's
Output with an error (RequestFailed for its reader); anything that escapes the step is
the engine's, and stops it: every reader hears EngineDead and `on_fatal` runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from preload.worker.engine.engine import Engine, EngineStats
from preload.worker.engine.faults import SequenceFault
from preload.worker.engine.output import Output
from preload.worker.engine.output_text import OutputText
from preload.worker.engine.sequence import Sequence

log = logging.getLogger("preload.worker")


class EngineDead(RuntimeError):
    """The engine stopped; no request can be answered until the worker is replaced."""


class RequestFailed(RuntimeError):
    """This request's own work failed inside the engine (the message names the stage);
    the engine and other requests go on."""


class RequestRefused(RequestFailed):
    """... by the request's own fault (its grammar cannot go on): a 400, not a 500."""


def failure(out: Output) -> RequestFailed:
    """What a reader raises for an Output with an error."""
    return (RequestRefused if out.refused else RequestFailed)(out.error)


class AsyncEngine:
    def __init__(self, engine: Engine, on_fatal: Callable[[], None] = lambda: None):
        """on_fatal: called (from the engine thread) when the engine fails; the worker then
        cannot answer correctly any more and should exit so that it is replaced."""
        self.engine, self.on_fatal = engine, on_fatal
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add" | "abort", seq)
        self._wake = threading.Event()
        self._readers: dict[int, asyncio.Queue] = {}  # seq id -> its Outputs (or the engine's death)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.steps = 0
        self.on_step: Callable[[], None] = lambda: None  # after each step, on the engine thread (metrics)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def use(self, engine: Engine) -> None:
        """Drive `engine` instead (before `start`: a supervised worker builds its server
        around the warm-up engine, and swaps in the real one when given its slot)."""
        if self._thread.ident is not None:
            raise RuntimeError("the engine thread is running")
        self.engine = engine

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def answering(self) -> bool:
        """Whether it answers now (/health's word; a worker's front says so of its core: front.py)."""
        return self.alive

    def in_flight(self) -> int:
        return len(self._readers)

    def progress(self) -> tuple[int, bool]:
        """(steps run so far, whether requests are waiting on the engine): a supervisor
        that sees the second stay true while the first stands still knows it hangs.
        Safe to call from any thread."""
        return self.steps, bool(self._readers)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def submit(self, seq: Sequence) -> AsyncIterator[Output]:
        """Check `seq` now (RequestError if the engine can never serve it), and return
        its Outputs: the sequence is queued when they are first read, each read gives
        what it produced since the last (merged), and the last is finished. An error in
        its own work raises RequestFailed; the engine's death, EngineDead. Closing the
        iterator early (client gone) aborts the sequence and frees its cache."""
        self.engine.check(seq)
        return self._outputs(seq)

    def abort(self, seq: Sequence) -> None:
        self._send("abort", seq)

    async def _outputs(self, seq: Sequence) -> AsyncIterator[Output]:
        if not self.alive:
            raise EngineDead(f"engine stopped: {self.error}")
        reader: asyncio.Queue = asyncio.Queue()
        self._readers[seq.id] = reader
        text = OutputText(self.engine.tokenizer, seq.params)  # (made here, on the event loop: the text is its work)
        self._send("add", seq)
        finished = False  # in the engine
        try:
            while not text.finished:
                news = [await reader.get()]
                while not reader.empty():
                    news.append(reader.get_nowait())
                if isinstance(news[-1], BaseException):
                    raise EngineDead(f"engine failed: {news[-1]}")
                out = Output.merge(news)
                finished = out.finished
                try:
                    out = text.add(out)
                except SequenceFault as fault:
                    raise RequestFailed(str(fault)) from None
                if out.error is not None:
                    raise failure(out)
                yield out
        finally:
            del self._readers[seq.id]
            if not finished:  # (the client left, its text failed, or a stop string ended it)
                self.abort(seq)

    def _send(self, op: str, seq: Sequence) -> None:
        self._inbox.put((op, seq))
        self._wake.set()

    def _deliver(self, news: list[Output] | BaseException) -> None:
        """On the event loop: a step's Outputs to their readers, or the engine's death to all."""
        if isinstance(news, BaseException):
            for reader in self._readers.values():
                reader.put_nowait(news)
            return
        landed = time.monotonic()
        for out in news:
            reader = self._readers.get(out.seq_id)
            if reader is not None:  # else its reader left; the abort is on its way
                out.land(landed)
                reader.put_nowait(out)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                while not self._inbox.empty():
                    op, seq = self._inbox.get()
                    engine.add(seq) if op == "add" else engine.abort(seq)
                if not engine.has_work():
                    if not engine.capture_idle():  # (idle: the decode graphs a lazy start left, one at a time)
                        self._wake.wait(0.5)
                        self._wake.clear()
                    continue
                outputs = engine.step()
                self.steps += 1
                self.on_step()
                if outputs:
                    self.loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as e:  # noqa: BLE001 - every reader must hear about it
            log.exception("engine thread failed")
            self.error = e
            self.loop.call_soon_threadsafe(self._deliver, e)
            self.on_fatal()
