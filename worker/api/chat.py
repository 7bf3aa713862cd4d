"""POST /v1/chat/completions: a conversation rendered with the chat template, one reply."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from preload.worker.api.chat_template import ChatTemplateError, render_chat
from preload.worker.api.errors import ApiError
from preload.worker.api.protocol import DEFAULT_MAX_TOKENS, ChatRequest, Envelope, usage
from preload.worker.api.serving import Serving, serving
from preload.worker.api.streaming import event_stream
from preload.worker.engine.output import Output
from preload.worker.engine.sampling_params import RequestError, SamplingParams
from preload.worker.engine.sequence import Sequence

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(req: ChatRequest, request: Request):
    s = serving(request)
    arrived = time.monotonic()
    s.admit(req)
    seq = Sequence(s.encode(prompt_text(s, req), "messages", add_special_tokens=False), sampling_params(req))
    [stream] = s.submit([seq], arrived)
    reply = Reply(s, req, seq)
    if req.stream:
        closing = reply.usage_chunk if req.include_usage else None
        return StreamingResponse(event_stream([stream], reply.chunk, opening=[reply.role_chunk()], closing=closing),
                                 media_type="text/event-stream")
    [out] = await s.collect(request, [stream])
    return reply.body(out)


def prompt_text(s: Serving, req: ChatRequest) -> str:
    if (req.chat_template is not None or req.chat_template_kwargs) and not s.trust_request_chat_template:
        raise ApiError(400, "chat_template and chat_template_kwargs change how the server renders prompts and are "
                       "refused; the operator can allow them with --trust-request-chat-template", param="chat_template")
    tokenizer = s.tokenizer
    try:
        return render_chat(
            req.chat_template or tokenizer.chat_template,
            [m.model_dump(exclude_none=True) for m in req.messages],
            req.add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            **(req.chat_template_kwargs or {}),
        )
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param="messages") from None


def sampling_params(req: ChatRequest) -> SamplingParams:
    """The engine's parameters; an error names the field the client sent."""
    max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None), DEFAULT_MAX_TOKENS)
    try:
        return req.sampling(max_tokens, (req.top_logprobs or 0) if req.logprobs else None, prompt_logprobs=False)
    except RequestError as e:
        sent = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                "logprobs": "top_logprobs"}.get(e.param, e.param)
        raise RequestError(str(e).replace(e.param, sent, 1), sent) from None


class Reply:
    """The assistant's reply as OpenAI writes it: whole (`body`) or a chunk per Output."""

    def __init__(self, s: Serving, req: ChatRequest, seq: Sequence):
        self.tokenizer, self.req, self.seq = s.tokenizer, req, seq
        self.envelope = Envelope.new("chatcmpl", s.model_name)
        self.generated = 0

    def role_chunk(self) -> dict:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self.envelope("chat.completion.chunk", [choice])

    def chunk(self, _: int, out: Output) -> dict:
        self.generated += len(out.token_ids)
        choice = {"index": 0, "delta": {"content": out.text} if out.text else {}, "logprobs": self._logprobs(out),
                  "finish_reason": out.finish_reason}
        return self.envelope("chat.completion.chunk", [choice])

    def usage_chunk(self) -> dict:
        return self.envelope("chat.completion.chunk", [], usage=usage(len(self.seq.prompt), self.generated))

    def body(self, out: Output) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": self._logprobs(out),
                  "finish_reason": out.finish_reason}
        return self.envelope("chat.completion", [choice], usage=usage(len(self.seq.prompt), len(out.token_ids)))

    def _logprobs(self, out: Output) -> dict | None:
        if not self.req.logprobs:
            return None
        tops = out.top_logprobs or [{}] * len(out.token_ids)
        return {"content": [
            self._entry(t, lp) | {"top_logprobs": [self._entry(k, v) for k, v in top.items()]}
            for t, lp, top in zip(out.token_ids, out.logprobs, tops)
        ]}

    def _entry(self, token: int, logprob: float) -> dict:
        s = self.tokenizer.token_text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}
