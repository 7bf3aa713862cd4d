"""The engine on its own thread, fed by asyncio: HTTP handlers never wait on a model step.

Requests and aborts are queued to the engine thread; after each step it pokes the
asyncio queue of every sequence that advanced. Handlers read the sequence's tokens
directly (only the engine thread appends to them).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from preload.worker.engine.engine import Engine
from preload.worker.engine.sequence import Sequence

log = logging.getLogger("preload.worker")


class EngineDead(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: Engine, on_fatal: Callable[[], None] = lambda: None):
        """on_fatal: called (from the engine thread) when a step fails; the worker then
        cannot answer correctly any more and should exit so that it is replaced."""
        self.engine, self.on_fatal = engine, on_fatal
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add" | "abort", seq)
        self._wake = threading.Event()
        self._waiters: dict[int, asyncio.Queue] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.steps = 0
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

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def in_flight(self) -> int:
        return len(self._waiters)

    def progress(self) -> tuple[int, bool]:
        """(steps run so far, whether requests are waiting on the engine): a supervisor
        that sees the second stay true while the first stands still knows it hangs.
        Safe to call from any thread."""
        return self.steps, bool(self._waiters)

    async def generate(self, seq: Sequence) -> AsyncIterator[Sequence]:
        """Yield `seq` each time it gains tokens, until it finishes. Closing the
        iterator early (client gone) aborts the sequence and frees its cache."""
        if not self.alive:
            raise EngineDead(f"engine stopped: {self.error}")
        self.engine.check(seq.prompt, seq.params.max_tokens)
        waiter: asyncio.Queue = asyncio.Queue()
        self._waiters[seq.id] = waiter
        self._send("add", seq)
        try:
            while True:
                error = await waiter.get()
                if error is not None:
                    raise EngineDead(f"engine failed: {error}")
                yield seq
                if seq.finished:
                    return
        finally:
            del self._waiters[seq.id]
            if not seq.finished:
                self._send("abort", seq)

    def _send(self, op: str, seq: Sequence) -> None:
        self._inbox.put((op, seq))
        self._wake.set()

    def _notify(self, seq_id: int, error: BaseException | None = None) -> None:
        waiter = self._waiters.get(seq_id)
        if waiter is not None:
            waiter.put_nowait(error)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                while not self._inbox.empty():
                    op, seq = self._inbox.get()
                    engine.add(seq) if op == "add" else engine.abort(seq)
                if not engine.has_work():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                updated = engine.step()
                self.steps += 1
                for seq in updated:
                    self.loop.call_soon_threadsafe(self._notify, seq.id)
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
            log.exception("engine thread failed")
            self.error = e
            for seq_id in list(self._waiters):
                self.loop.call_soon_threadsafe(self._notify, seq_id, e)
            self.on_fatal()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
