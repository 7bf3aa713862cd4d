"""POST /v1/chat/completions: a conversation rendered with the chat template, n replies.

A reply's text is read as vLLM reads it: its thinking apart (`reasoning_content`, with
--reasoning-parser) and its tool calls apart (`tool_calls`, tools.py), whole or as
stream deltas; the rest is `content`.
"""

from __future__ import annotations

import time
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from preload.worker.api import reasoning
from preload.worker.api.chat_template import ChatTemplateError, render_chat
from preload.worker.api.errors import ApiError
from preload.worker.api.logprobs import prompt_logprobs_entries
from preload.worker.api.protocol import ChatRequest, Envelope, usage
from preload.worker.api.serving import Serving, serving
from preload.worker.api.streaming import event_stream
from preload.worker.api.tools import PARSERS, ToolChoice, ToolError, ToolStream
from preload.worker.engine.output import Output
from preload.worker.engine.sampling_params import RequestError, SamplingParams
from preload.worker.engine.sequence import Sequence

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(req: ChatRequest, request: Request):
    s = serving(request)
    arrived = time.monotonic()
    s.admit(req, request)
    tools = tool_choice(s, req.tools, req.tool_choice, req.has_grammar)
    prompt = s.encode(prompt_text(s, req), "messages", add_special_tokens=False)
    # Without max_tokens a reply may run to the end of the context, as in vLLM.
    default = max(1, s.engine.stats().max_model_len - len(prompt))
    seqs = [Sequence(prompt, sampling_params(req, default, i, tools, s.tool_parser)) for i in range(req.n)]
    streams = s.submit(seqs, arrived)
    reply = Reply(s, req, seqs, tools)
    if req.stream:
        closing = reply.usage_chunk if req.include_usage else None
        return StreamingResponse(event_stream(streams, reply.chunk, opening=reply.role_chunks(), closing=closing),
                                 media_type="text/event-stream")
    return reply.body(await s.collect(request, streams))


def tool_choice(s: Serving, tools: list[dict] | None, choice: str | dict | None, has_grammar: bool) -> ToolChoice:
    """What a request's tools ask (a 400 naming the field at fault); `has_grammar`: the
    request holds its output to a structured-output grammar too."""
    try:
        choice = ToolChoice.of(tools, choice, s.tool_parser)
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    if choice.grammar is not None and has_grammar:
        raise ApiError(400, f"tool_choice {choice.mode} holds the output to the tool's schema; it cannot also follow "
                       "response_format or structured_outputs", param="tool_choice")
    return choice


def prompt_text(s: Serving, req: ChatRequest) -> str:
    if (req.chat_template is not None or req.chat_template_kwargs) and not s.options.trust_request_chat_template:
        raise ApiError(400, "chat_template and chat_template_kwargs change how the server renders prompts and are "
                       "refused; the operator can allow them with --trust-request-chat-template", param="chat_template")
    return render(s, [m.for_template() for m in req.messages], req.tools, "messages", req.add_generation_prompt,
                  req.chat_template, req.chat_template_kwargs)


def render(s: Serving, messages: list[dict], tools: list[dict] | None, param: str, add_generation_prompt: bool = True,
           template: str | None = None, variables: dict | None = None) -> str:
    """A conversation as prompt text, by `template` (a trusted client's) or the server's
    chat template; a 400 naming `param` if the template refuses it."""
    tokenizer = s.tokenizer
    try:
        return render_chat(
            template or s.chat_template,
            messages,
            add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            **({"tools": tools} if tools else {}),
            **(variables or {}),
        )
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param=param) from None


def sampling_params(req: ChatRequest, default_max_tokens: int, choice: int, tools: ToolChoice,
                    parser: str | None) -> SamplingParams:
    """The engine's parameters for one choice; an error names the field the client sent."""
    max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None), default_max_tokens)
    try:
        params = req.sampling(max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                              prompt_logprobs=req.prompt_logprobs, choice=choice)
    except RequestError as e:
        sent = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                "logprobs": "top_logprobs"}.get(e.param, e.param)
        raise RequestError(str(e).replace(e.param, sent, 1), sent) from None
    return with_tools(params, tools, parser)


def with_tools(params: SamplingParams, tools: ToolChoice, parser: str | None) -> SamplingParams:
    """`params` as the request's tools need them: held to the tool's schema (named,
    required); with "auto", special tokens kept where the parser's markers are such."""
    if tools.grammar is not None:
        params = replace(params, grammar=tools.grammar)
    if tools.mode == "auto" and PARSERS[parser].SPECIAL:  # (its markers are special tokens: the parser must see them)
        params = replace(params, skip_special_tokens=False)
    return params


class ChoiceText:
    """One choice's text read apart: reasoning (if the operator asked and no grammar holds
    the output), tool calls, content; whole (`message`) or piece by piece (`delta`)."""

    def __init__(self, tools: ToolChoice, parser: str | None, reasoning_parser: str | None, grammar: bool):
        self.tools, self.parser = tools, parser
        self.thinks = reasoning_parser is not None and not grammar  # (JSON held to a schema has no thinking)
        self.thoughts = reasoning.ReasoningStream() if self.thinks else None
        self.calls = ToolStream(tools, parser)
        self.called = False  # a tool call was sent

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole reply's message, and its finish_reason."""
        thought, content = reasoning.split(text) if self.thinks else (None, text)
        content, calls = self.tools.calls(content, self.parser) if content is not None else (None, [])
        message = {"role": "assistant", "content": content}
        if self.thinks:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = calls
            self.called = True
        return message, self.finish_reason(finish_reason)

    def delta(self, piece: str, last: bool) -> dict:
        thought, piece = self.thoughts.delta(piece, last) if self.thinks else ("", piece)
        content, calls = self.calls.delta(piece, last)
        delta = {}
        if thought:
            delta["reasoning_content"] = thought
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
            self.called = True
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """vLLM's: "tool_calls" once calls were made (auto, required), "stop" for a named call."""
        if reason == "stop" and self.called and self.tools.mode in ("auto", "required"):
            return "tool_calls"
        return reason


class Reply:
    """The assistant's replies (one per choice) as OpenAI writes them: whole (`body`) or a
    chunk per Output (`chunk`)."""

    def __init__(self, s: Serving, req: ChatRequest, seqs: list[Sequence], tools: ToolChoice):
        self.tokenizer, self.req, self.seqs = s.tokenizer, req, seqs
        self.envelope = Envelope.new("chatcmpl", s.model_name)
        self.generated = [0] * len(seqs)
        self.cached = 0  # prompt tokens the prefix cache held
        grammar = tools.grammar is not None or req.has_grammar
        self.texts = [ChoiceText(tools, s.tool_parser, s.options.reasoning_parser, grammar) for _ in seqs]
        self.prompt_logprobs = None  # vLLM's prompt_logprobs, once known (the request asked)

    def role_chunks(self) -> list[dict]:
        extra = {"usage": self._usage()} if self.req.continuous_usage else {}  # (vLLM's: the prompt, 0 completion)
        return [self.envelope("chat.completion.chunk", [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}], **extra)
                for i in range(len(self.seqs))]

    def chunk(self, i: int, out: Output) -> dict | None:
        """The chunk for an Output; None when it has nothing to say (text held back: a
        tool call or </think> may be arriving)."""
        self.generated[i] += len(out.token_ids)
        self._first(out)
        text = self.texts[i]
        delta = text.delta(out.text, out.finished)
        choice = {"index": i, "delta": delta, "logprobs": self._logprobs(out),
                  "finish_reason": text.finish_reason(out.finish_reason)}
        if not delta and choice["finish_reason"] is None and choice["logprobs"] is None and not self.req.continuous_usage:
            return None
        extra = {"usage": self._usage()} if self.req.continuous_usage else {}
        return self.envelope("chat.completion.chunk", [choice], **extra)

    def usage_chunk(self) -> dict:
        return self.envelope("chat.completion.chunk", [], usage=self._usage())

    def body(self, results: list[Output]) -> dict:
        self.generated = [len(out.token_ids) for out in results]
        choices = []
        for i, out in enumerate(results):
            self._first(out)
            message, finish = self.texts[i].message(out.text, out.finish_reason)
            choices.append({"index": i, "message": message, "logprobs": self._logprobs(out), "finish_reason": finish})
        extra = {"prompt_logprobs": self.prompt_logprobs} if self.req.prompt_logprobs is not None else {}
        return self.envelope("chat.completion", choices, usage=self._usage(), **extra)

    def _first(self, out: Output) -> None:
        """What a sequence's first Output says of the prompt (the same for every choice)."""
        if out.cached_tokens is not None:
            self.cached = out.cached_tokens
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_logprobs_entries(self.tokenizer, self.seqs[0].prompt, out)

    def _usage(self) -> dict:
        # vLLM's count: the prompt once, whatever n.
        return usage(len(self.seqs[0].prompt), sum(self.generated), self.cached)

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
