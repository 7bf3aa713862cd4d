"""`--api-key`: every /v1 route wants `Authorization: Bearer KEY` (as vLLM's, which leaves
/health, /metrics and the other probes open: load balancers and scrapers hold no key).
The key is compared in constant time; a request without it gets a 401 before anything
else reads it."""

from __future__ import annotations

import hmac
import json

from preload.worker.api.protocol import error_body


class RequireKey:
    """Plain ASGI: a refused request's body is never read."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        sent = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(sent, self.expected):
            return await self.app(scope, receive, send)
        body = json.dumps(error_body("a valid API key is needed: Authorization: Bearer <key>", "authentication_error",
                                     401)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
