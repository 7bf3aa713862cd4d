"""What every endpoint shares: the engine behind its narrow interface (submit, abort,
stats), the tokenizer, the served model's name, the worker's phase and metrics; and the
steps every request takes: admit it, encode its text, submit its sequences, collect or
stream their Outputs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request

from preload.checkpoint.tokenizer import Tokenizer
from preload.options import WorkerOptions
from preload.worker.api.errors import ApiError
from preload.worker.api.metrics import WorkerMetrics
from preload.worker.api.protocol import Request as ApiRequest
from preload.worker.api.state import WorkerState
from preload.worker.engine.async_engine import AsyncEngine, EngineDead, RequestFailed, RequestRefused
from preload.worker.engine.output import Output
from preload.worker.engine.sequence import Sequence

log = logging.getLogger("preload.worker")

@dataclass
class Serving:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_names: tuple[str, ...]  # the ids served (--served-model-name); responses name the first
    state: WorkerState
    metrics: WorkerMetrics
    options: WorkerOptions = field(default_factory=WorkerOptions)

    def __post_init__(self):
        # The operator's chat template (--chat-template), read once, else the checkpoint's.
        t = self.options.chat_template
        self.chat_template = t.read_text() if t is not None else self.tokenizer.chat_template

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def tool_parser(self) -> str | None:
        """The parser of "auto" tool choice, if the operator enabled it."""
        return self.options.tool_call_parser if self.options.enable_auto_tool_choice else None

    def admit(self, req: ApiRequest, request: Request) -> None:
        """Refuse a request for another model, or one that arrives before we can answer;
        log the fields it sent that are ignored, and name them in the response's
        x-ignored-fields header (app.py)."""
        if req.ignored_fields:
            log.warning("the following fields were present in the request but ignored: %r", req.ignored_fields)
            request.state.ignored_fields = req.ignored_fields
        self.check_model(req.model)
        if self.state.phase == "starting":  # a draining worker still answers what reaches it
            raise ApiError(503, "worker is starting", "service_unavailable")
        if not self.engine.alive:
            raise ApiError(503, "engine failed; the worker must be restarted", "service_unavailable")

    def check_model(self, model: str | None) -> None:
        """404 for a request that names another model than those served."""
        if model is not None and model not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise ApiError(404, f"model {model!r} does not exist; this server serves {served}", "not_found_error",
                           "model")

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
        self.metrics.label(self.metrics.prompt_tokens).inc(sum(len(seq.prompt) for seq in seqs))
        return [self._timed(o, seq, arrived) for o, seq in zip(outputs, seqs)]

    async def _timed(self, outputs: AsyncIterator[Output], seq: Sequence, arrived: float) -> AsyncIterator[Output]:
        m = self.metrics
        async with aclosing(outputs):  # closing this closes the engine's iterator: the sequence is aborted
            first = last = None
            generated = 0
            async for out in outputs:
                # Each engine step's tokens timed when they landed, several steps merged or not (a
                # first Output without tokens, a prompt scored, is timed as it is read).
                for landed in out.landed or ((time.monotonic(),) if out.token_ids or first is None else ()):
                    if first is None:
                        first = landed
                        m.label(m.ttft).observe(landed - arrived)
                    else:
                        m.label(m.tpot).observe(landed - last)
                    last = landed
                generated += len(out.token_ids)
                m.label(m.generation_tokens).inc(len(out.token_ids))
                if out.finished and first is not None:
                    m.finished(seq, out.finish_reason, generated, arrived, first, last)
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
        except RequestRefused as e:  # the request's grammar could not go on: its own fault
            raise ApiError(400, str(e), "invalid_request_error") from None
        except RequestFailed as e:  # not provably the client's fault: a server error
            raise ApiError(500, str(e), "server_error") from None
        finally:
            for t in tasks:
                t.cancel()


def serving(request: Request) -> Serving:
    return request.app.state.serving


async def until_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it (and so aborting its sequences) as soon as the client
    leaves: the server's http.disconnect ends the wait at once, nothing polls for it."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request was cancelled itself: so is its work
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task not in done:
        task.cancel()
        raise ApiError(499, "client closed the request")
    return task.result()


async def disconnected(request: Request) -> None:
    """Return once the client has gone. The request's body was read before, so the next
    ASGI message is http.disconnect, which uvicorn sends the moment the connection is
    lost (it waits for it, no timer); a server that answers anything else instead is
    asked again a little later rather than at once (no busy loop)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)
