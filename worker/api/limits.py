"""The largest request body a worker reads."""

from __future__ import annotations

import json

from preload.worker.api.protocol import error_body


class BodyLimit:
    """ASGI wrapper that refuses request bodies over `limit` bytes with an OpenAI-style
    413: at once when Content-Length says so, else as soon as the chunks add up to more
    (the app then sees a disconnect and whatever it answers is replaced)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def _refuse(self, send) -> None:
        body = json.dumps(error_body(f"request body larger than {self.limit} bytes", code=413)).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._refuse(send)
        seen, over = 0, False

        async def counted():
            nonlocal seen, over
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                over = True
                return {"type": "http.disconnect"}
            return message

        async def unless_over(message):
            if not over:
                await send(message)

        try:
            await self.app(scope, counted, unless_over)
        except Exception:
            if not over:
                raise
        if over:
            await self._refuse(send)
