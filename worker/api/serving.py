"""What every endpoint shares: the engine behind its narrow interface (submit, abort,
stats), the tokenizer, the served model's name, the worker's phase and metrics; and the
steps every request takes: admit it, encode its text, submit its sequences, collect or
stream their Outputs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request

from preload.checkpoint.tokenizer import Tokenizer
from preload.worker.api.errors import ApiError
from preload.worker.api.metrics import WorkerMetrics
from preload.worker.api.protocol import Request as ApiRequest
from preload.worker.api.state import WorkerState
from preload.worker.engine.async_engine import AsyncEngine, EngineDead, RequestFailed
from preload.worker.engine.output import Output
from preload.worker.engine.sequence import Sequence


@dataclass
class Serving:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    state: WorkerState
    metrics: WorkerMetrics
    trust_request_chat_template: bool = False

    def admit(self, req: ApiRequest) -> None:
        """Refuse a request for another model, or one that arrives before we can answer."""
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model")
        if self.state.phase == "starting":  # a draining worker still answers what reaches it
            raise ApiError(503, "worker is starting", "service_unavailable")
        if not self.engine.alive:
            raise ApiError(503, "engine failed; the worker must be restarted", "service_unavailable")

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of request text; 400 naming `param` for text that is not Unicode
        (JSON can carry a lone surrogate, which the tokenizer cannot take)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"{param} is not valid Unicode: {e.reason} at character {e.start}", param=param) from None
        return self.tokenizer.encode(text, add_special_tokens)

    def submit(self, seqs: list[Sequence], arrived: float) -> list[AsyncIterator[Output]]:
        """Each sequence's Outputs. All are checked before any is queued (RequestError,
        answered 400), so a request is taken whole or not at all."""
        outputs = [self.engine.submit(seq) for seq in seqs]
        self.metrics.prompt_tokens.inc(sum(len(seq.prompt) for seq in seqs))
        return [self._timed(o, arrived) for o in outputs]

    async def _timed(self, outputs: AsyncIterator[Output], arrived: float) -> AsyncIterator[Output]:
        async with aclosing(outputs):  # closing this closes the engine's iterator: the sequence is aborted
            last = None
            async for out in outputs:
                now = time.monotonic()
                if last is None:
                    self.metrics.ttft.observe(now - arrived)
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                self.metrics.generation_tokens.inc(len(out.token_ids))
                yield out

    async def collect(self, request: Request, streams: list[AsyncIterator[Output]]) -> list[Output]:
        """The whole result of each stream; aborted if the client leaves or one fails."""

        async def whole(outputs: AsyncIterator[Output]) -> Output:
            return Output.merge([out async for out in outputs])

        tasks = [asyncio.ensure_future(whole(s)) for s in streams]
        try:
            return await until_disconnected(request, asyncio.gather(*tasks))
        except EngineDead as e:
            raise ApiError(503, str(e), "service_unavailable") from None
        except RequestFailed as e:  # not provably the client's fault: a server error
            raise ApiError(500, str(e), "server_error") from None
        finally:
            for t in tasks:
                t.cancel()


def serving(request: Request) -> Serving:
    return request.app.state.serving


async def until_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it (and so aborting its sequences) if the client leaves."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait([task], timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            raise ApiError(499, "client closed the request")
    return task.result()
