"""Server-sent events: the Outputs of a request's sequences merged into one stream that
ends with [DONE]. A sequence that fails shows as an error event; the others go on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable

from preload.worker.api.protocol import error_body
from preload.worker.engine.async_engine import RequestRefused
from preload.worker.engine.output import Output


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def event_stream(
    streams: list[AsyncIterator[Output]],
    render: Callable[[int, Output], dict | None],
    opening: Iterable[dict] = (),
    closing: Callable[[], dict] | None = None,
) -> AsyncIterator[str]:
    """`render(i, output)`: the chunk for an Output of sequence i (None: nothing to send);
    `opening`: chunks sent
    first (chat: the role); `closing()`: the last chunk before [DONE] (usage), if any."""
    updates: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Output]) -> None:
        try:
            async for out in stream:
                await updates.put((i, out))
        except Exception as e:  # noqa: BLE001 - the headers are sent: report it in the stream
            await updates.put((i, e))
        await updates.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for chunk in opening:
            yield sse(chunk)
        remaining = len(streams)
        while remaining:
            i, event = await updates.get()
            if event is done:
                remaining -= 1
            elif isinstance(event, RequestRefused):  # (the status line went out already: said in the stream)
                yield sse(error_body(str(event), "invalid_request_error", 400))
            elif isinstance(event, Exception):
                yield sse(error_body(str(event), "server_error", 500))
            elif (chunk := render(i, event)) is not None:
                yield sse(chunk)
        if closing is not None:
            yield sse(closing())
        yield sse("[DONE]")
    finally:
        for t in tasks:
            t.cancel()  # client gone: the engine aborts what is unfinished
