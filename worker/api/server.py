"""The worker's HTTP API: OpenAI-compatible completions and chat, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from preload.worker.engine.async_engine import AsyncEngine, EngineDead
from preload.worker.api.chat_template import ChatTemplateError, render_chat
from preload.worker.engine.engine import RequestError
from preload.worker.api.protocol import ChatRequest, CompletionRequest, error_body
from preload.worker.engine.sequence import Sequence
from preload.checkpoint.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


@dataclass
class WorkerState:
    """What /health reports: starting -> ready -> draining."""

    phase: str = "starting"
    started: float = field(default_factory=time.monotonic)

    @property
    def serving(self) -> bool:
        return self.phase == "ready"


class WorkerMetrics:
    def __init__(self, engine: AsyncEngine):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("preload_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("preload_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("preload_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("preload_time_to_first_token_seconds", "Request arrival to first token", registry=r,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.itl = Histogram("preload_inter_token_latency_seconds", "Time between tokens of a request", registry=r,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        # Looked up at each scrape: a supervised worker swaps its warm-up engine for the real one.
        def sched():
            return engine.engine.scheduler

        def blocks():
            return engine.engine.blocks

        Gauge("preload_queue_depth", "Requests waiting to be scheduled", registry=r).set_function(lambda: len(sched().waiting))
        Gauge("preload_running_requests", "Requests in the running batch", registry=r).set_function(lambda: len(sched().running))
        Gauge("preload_kv_blocks_used", "KV cache blocks in use", registry=r).set_function(lambda: blocks().used)
        Gauge("preload_kv_blocks_total", "KV cache blocks", registry=r).set_function(lambda: blocks().num_blocks)
        Gauge("preload_preemptions", "Sequences preempted so far", registry=r).set_function(lambda: sched().preemptions)


class TextStream:
    """Incremental text of a sequence: never emits a half-decoded character or text
    that might turn out to begin a stop string."""

    def __init__(self, seq: Sequence, text: Callable[[Sequence], str]):
        self.seq, self.text, self.sent, self.tokens_sent = seq, text, 0, 0
        self.hold = max(map(len, seq.params.stop), default=1) - 1

    def delta(self) -> tuple[str, list[int]]:
        full = self.text(self.seq)
        end = len(full)
        if not self.seq.finished:
            end = len(full.rstrip("\ufffd")) - self.hold
        chunk = full[self.sent : max(end, self.sent)]
        self.sent += len(chunk)
        new_tokens = list(range(self.tokens_sent, len(self.seq.output)))
        self.tokens_sent = len(self.seq.output)
        return chunk, new_tokens


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


async def until_disconnected(request: Request, work):
    """Await `work`, cancelling it (and so aborting its sequences) if the client leaves."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait([task], timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            raise ApiError(499, "client closed the request")
    return task.result()


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def create_app(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    model_name: str,
    state: WorkerState,
    trust_request_chat_template: bool = False,
    lifespan=None,
) -> FastAPI:
    app = FastAPI(title="preload worker", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = WorkerMetrics(engine)
    app.state.metrics = metrics

    def text_of(seq: Sequence) -> str:
        return engine.engine.text(seq)

    # ---- errors: always {"error": {...}} ------------------------------------------------

    def error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, type_, status, param), status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return error(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error(400, f"{where}: {first.get('msg')}" if where else first.get("msg", "invalid request"), param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return error(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        return error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        if state.phase == "draining":
            response.headers["connection"] = "close"  # the client's next request goes to another worker
        return response

    # ---- probes -------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        ok = state.serving and engine.alive
        phase = state.phase if engine.alive else "engine failed"
        return JSONResponse({"status": phase}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_route():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "preload",
                "max_model_len": engine.engine.max_model_len}
        return {"object": "list", "data": [card]}

    # ---- helpers ------------------------------------------------------------------------

    def check(req) -> None:
        if req.model is not None and req.model != model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}", "not_found_error", "model")
        if state.phase == "starting":  # a draining worker still answers what reaches it
            raise ApiError(503, "worker is starting", "service_unavailable")
        if not engine.alive:
            raise ApiError(503, "engine failed; the worker must be restarted", "service_unavailable")

    def start(seqs: list[Sequence]) -> None:
        for seq in seqs:
            try:
                engine.engine.check(seq.prompt, seq.params.max_tokens)
            except RequestError as e:
                raise ApiError(400, str(e), param="prompt") from None
        metrics.prompt_tokens.inc(sum(len(s.prompt) for s in seqs))

    async def follow(seq: Sequence, arrived: float) -> AsyncIterator[Sequence]:
        """engine.generate with latency metrics."""
        last = None
        async for s in engine.generate(seq):
            now = time.monotonic()
            if last is None:
                metrics.ttft.observe(now - arrived)
            else:
                metrics.itl.observe(now - last)
            last = now
            yield s
        metrics.generation_tokens.inc(len(seq.output))

    async def run(seq: Sequence, arrived: float) -> Sequence:
        async for _ in follow(seq, arrived):
            pass
        return seq

    def usage(seqs: list[Sequence]) -> dict:
        p, c = sum(len(s.prompt) for s in seqs), sum(len(s.output) for s in seqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def usage_chunk(req, rid: str, created: int, obj: str):
        if not (req.stream_options and req.stream_options.get("include_usage")):
            return None
        return lambda u: {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [], "usage": u}

    def top_dict(top: dict[int, float]) -> dict[str, float]:
        return {tokenizer.token_text(t): lp for t, lp in top.items()}

    async def stream(make_chunks, usage_chunk, seqs: list[Sequence], arrived: float) -> AsyncIterator[str]:
        """Merge the sequences' progress into one SSE stream, ending with [DONE].
        make_chunks(i, (text, token indices), finish_reason) gives the chunks for an
        update of sequence i (i None: the opening chunks); usage_chunk, if any, the last."""
        updates: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, seq: Sequence):
            try:
                async for _ in follow(seq, arrived):
                    await updates.put((i, None))
            except Exception as e:  # noqa: BLE001 - reported in the stream
                await updates.put((i, e))
            await updates.put((i, "done"))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(seqs)]
        streams = [TextStream(s, text_of) for s in seqs]
        try:
            for chunk in make_chunks(None, None, None):  # opening chunks (chat: the role)
                yield sse(chunk)
            remaining = len(seqs)
            while remaining:
                i, event = await updates.get()
                if event == "done":
                    remaining -= 1
                    continue
                if isinstance(event, Exception):
                    yield sse(error_body(str(event), "server_error", 500))
                    continue
                text, tokens = streams[i].delta()
                finished = seqs[i].finish_reason if seqs[i].finished else None
                if text or finished or tokens:
                    for chunk in make_chunks(i, (text, tokens), finished):
                        yield sse(chunk)
            if usage_chunk:
                yield sse(usage_chunk(usage(seqs)))
            yield sse("[DONE]")
        finally:
            for t in tasks:
                t.cancel()  # client gone: the engine aborts what is unfinished

    # ---- /v1/completions ----------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        arrived = time.monotonic()
        check(req)
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts_raw()]
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        score_only = max_tokens == 0  # echo with max_tokens=0: score the prompt, generate nothing
        try:
            params = req.sampling(max(max_tokens, 1), req.logprobs, prompt_logprobs=req.echo and req.logprobs is not None)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        seqs = [Sequence(p, params) for p in prompts]
        start(seqs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_block(seq: Sequence, tokens: list[int], with_prompt: bool) -> dict | None:
            if req.logprobs is None:
                return None
            ids, lps, tops = [], [], []
            if with_prompt:
                ids += seq.prompt
                lps += seq.prompt_logprobs or [None] * len(seq.prompt)
                tops += [None] * len(seq.prompt)
            ids += [seq.output[t] for t in tokens]
            lps += [seq.logprobs[t] for t in tokens]
            tops += [top_dict(seq.top_logprobs[t]) if req.logprobs else None for t in tokens]
            texts = [tokenizer.token_text(t) for t in ids]
            offsets = [sum(len(x) for x in texts[:k]) for k in range(len(texts))]
            return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

        if req.stream:
            echoed = set()

            def chunks(i, delta, finished):
                if i is None:
                    return []
                text, tokens = ("", []) if score_only else delta
                first = req.echo and i not in echoed  # the prompt goes out once, in the first chunk
                if first:
                    echoed.add(i)
                    text = tokenizer.decode(seqs[i].prompt) + text
                choice = {"index": i, "text": text, "logprobs": logprobs_block(seqs[i], tokens, first),
                          "finish_reason": finished}
                return [{"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": [choice]}]

            return StreamingResponse(stream(chunks, usage_chunk(req, rid, created, "text_completion"), seqs, arrived), media_type="text/event-stream")

        try:
            await until_disconnected(request, asyncio.gather(*(run(s, arrived) for s in seqs)))
        except EngineDead as e:
            raise ApiError(503, str(e), "service_unavailable") from None
        choices = []
        for i, seq in enumerate(seqs):
            generated = [] if score_only else list(range(len(seq.output)))
            text = "" if score_only else text_of(seq)
            if req.echo:
                text = tokenizer.decode(seq.prompt) + text
            choices.append({"index": i, "text": text, "logprobs": logprobs_block(seq, generated, req.echo),
                            "finish_reason": "length" if score_only else seq.finish_reason})
        u = usage(seqs)
        if score_only:
            u = u | {"completion_tokens": 0, "total_tokens": u["prompt_tokens"]}
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices, "usage": u}

    # ---- /v1/chat/completions -----------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        arrived = time.monotonic()
        check(req)
        if (req.chat_template is not None or req.chat_template_kwargs) and not trust_request_chat_template:
            raise ApiError(400, "chat_template and chat_template_kwargs change how the server renders prompts and are "
                           "refused; the operator can allow them with --trust-request-chat-template", param="chat_template")
        try:
            text = render_chat(
                req.chat_template or tokenizer.chat_template,
                [m.model_dump(exclude_none=True) for m in req.messages],
                req.add_generation_prompt,
                bos_token=tokenizer.bos_token or "",
                eos_token=tokenizer.eos_token or "",
                **(req.chat_template_kwargs or {}),
            )
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None), DEFAULT_MAX_TOKENS)
        n_top = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = req.sampling(max_tokens, n_top, prompt_logprobs=False)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        seq = Sequence(tokenizer.encode(text, add_special_tokens=False), params)
        start([seq])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def content_logprobs(tokens: list[int]) -> dict | None:
            if not req.logprobs:
                return None

            def entry(t: int, lp: float) -> dict:
                s = tokenizer.token_text(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            return {"content": [
                entry(seq.output[k], seq.logprobs[k])
                | {"top_logprobs": [entry(t, lp) for t, lp in (seq.top_logprobs[k] if n_top else {}).items()]}
                for k in tokens
            ]}

        def envelope(choice: dict, obj: str) -> dict:
            return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}

        if req.stream:
            def chunks(i, delta, finished):
                if i is None:
                    return [envelope({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}, "chat.completion.chunk")]
                text, tokens = delta
                return [envelope({"index": 0, "delta": {"content": text} if text else {},
                                  "logprobs": content_logprobs(tokens), "finish_reason": finished}, "chat.completion.chunk")]

            return StreamingResponse(stream(chunks, usage_chunk(req, rid, created, "chat.completion.chunk"), [seq], arrived), media_type="text/event-stream")

        try:
            await until_disconnected(request, run(seq, arrived))
        except EngineDead as e:
            raise ApiError(503, str(e), "service_unavailable") from None
        choice = {"index": 0, "message": {"role": "assistant", "content": text_of(seq)},
                  "logprobs": content_logprobs(list(range(len(seq.output)))), "finish_reason": seq.finish_reason}
        return envelope(choice, "chat.completion") | {"usage": usage([seq])}

    return app
