"""POST /v1/chat/completions: a conversation rendered with the chat template, n replies."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from preload.worker.api.chat_template import ChatTemplateError, render_chat
from preload.worker.api.errors import ApiError
from preload.worker.api.protocol import ChatRequest, Envelope, usage
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
    s.admit(req, request)
    prompt = s.encode(prompt_text(s, req), "messages", add_special_tokens=False)
    # Without max_tokens a reply may run to the end of the context, as in vLLM.
    default = max(1, s.engine.stats().max_model_len - len(prompt))
    seqs = [Sequence(prompt, sampling_params(req, default, i)) for i in range(req.n)]
    streams = s.submit(seqs, arrived)
    reply = Reply(s, req, seqs)
    if req.stream:
        closing = reply.usage_chunk if req.include_usage else None
        return StreamingResponse(event_stream(streams, reply.chunk, opening=reply.role_chunks(), closing=closing),
                                 media_type="text/event-stream")
    return reply.body(await s.collect(request, streams))


def prompt_text(s: Serving, req: ChatRequest) -> str:
    if (req.chat_template is not None or req.chat_template_kwargs) and not s.trust_request_chat_template:
        raise ApiError(400, "chat_template and chat_template_kwargs change how the server renders prompts and are "
                       "refused; the operator can allow them with --trust-request-chat-template", param="chat_template")
    tokenizer = s.tokenizer
    try:
        return render_chat(
            req.chat_template or tokenizer.chat_template,
            [m.for_template() for m in req.messages],
            req.add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            **({"tools": req.tools} if req.tools else {}),
            **(req.chat_template_kwargs or {}),
        )
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param="messages") from None


def sampling_params(req: ChatRequest, default_max_tokens: int, choice: int) -> SamplingParams:
    """The engine's parameters for one choice; an error names the field the client sent."""
    max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None), default_max_tokens)
    try:
        return req.sampling(max_tokens, (req.top_logprobs or 0) if req.logprobs else None, prompt_logprobs=False,
                            choice=choice)
    except RequestError as e:
        sent = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                "logprobs": "top_logprobs"}.get(e.param, e.param)
        raise RequestError(str(e).replace(e.param, sent, 1), sent) from None


class Reply:
    """The assistant's replies (one per choice) as OpenAI writes them: whole (`body`) or a
    chunk per Output (`chunk`)."""

    def __init__(self, s: Serving, req: ChatRequest, seqs: list[Sequence]):
        self.tokenizer, self.req, self.seqs = s.tokenizer, req, seqs
        self.envelope = Envelope.new("chatcmpl", s.model_name)
        self.generated = [0] * len(seqs)

    def role_chunks(self) -> list[dict]:
        return [self.envelope("chat.completion.chunk", [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}])
                for i in range(len(self.seqs))]

    def chunk(self, i: int, out: Output) -> dict:
        self.generated[i] += len(out.token_ids)
        choice = {"index": i, "delta": {"content": out.text} if out.text else {}, "logprobs": self._logprobs(out),
                  "finish_reason": out.finish_reason}
        return self.envelope("chat.completion.chunk", [choice])

    def usage_chunk(self) -> dict:
        return self.envelope("chat.completion.chunk", [], usage=self._usage())

    def body(self, results: list[Output]) -> dict:
        self.generated = [len(out.token_ids) for out in results]
        choices = [{"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": self._logprobs(out),
                    "finish_reason": out.finish_reason} for i, out in enumerate(results)]
        return self.envelope("chat.completion", choices, usage=self._usage())

    def _usage(self) -> dict:
        # vLLM's count: the prompt once, whatever n.
        return usage(len(self.seqs[0].prompt), sum(self.generated))

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
