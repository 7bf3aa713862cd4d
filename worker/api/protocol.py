"""Request and response shapes of the OpenAI-compatible API.

pydantic checks the shape of a request (types, strictly: `true` is not the number 1,
and token ids are not booleans); the ranges of the sampling parameters are checked in
one place below the API, SamplingParams, whose RequestError names the parameter.

Unknown fields are ignored, as vLLM ignores them (the SDKs send fields of newer API
versions: `store`, `parallel_tool_calls`, ...): the worker logs them and names them in the
`x-ignored-fields` response header. Except fields that would change how the server
renders or processes the request (a template, template or processor kwargs, guided
decoding we do not know, logits processors): a client that believes it changed that must
hear that it did not, so those are refused (the declared `chat_template` fields only unless the
operator trusts clients: chat.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from preload.worker.api.structured import grammar_of
from preload.worker.engine.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI and vLLM
MAX_N = 128  # choices of one request at most


def processing_field(name: str) -> bool:
    """Whether an unknown field would change server-side processing (refused, never ignored)."""
    return ("template" in name or name.endswith("_kwargs") or name.startswith("guided_")
            or name in ("logits_processors", "allowed_token_ids", "bad_words")
            or name in ("functions", "function_call"))  # the legacy tools: they would be rendered into the prompt


class Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    _grammar: str | None = None  # the structured output asked for, compiled once (structured.py)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = None
    stream: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-prob, rank and the n most likely
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    user: str | None = None
    cache_salt: str | None = None  # vLLM's extension: prefix-cache blocks shared only within one salt
    stream_options: dict[Literal["include_usage", "continuous_usage_stats"], bool] | None = None
    response_format: dict | None = None
    # vLLM's structured-output extension: {"json": schema} | {"regex": pattern} | {"choice": [strings]}
    structured_outputs: dict | None = None
    guided_json: dict | None = None  # vLLM's older spellings of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @model_validator(mode="after")
    def _check_common(self) -> Request:
        refused = sorted(name for name in self.model_extra or {} if processing_field(name))
        if refused:
            raise ValueError(f"{', '.join(refused)}: changes how the server processes the request; not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}) other than n ({self.n}) is not supported")
        for key in self.logit_bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
        self._grammar = grammar_of(self.response_format, self.structured_outputs, self.guided_json, self.guided_regex,
                                   self.guided_choice)
        return self

    @property
    def has_grammar(self) -> bool:
        """Whether the request holds its output to a structured-output grammar."""
        return self._grammar is not None

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """Usage so far in every chunk (vLLM's continuous_usage_stats, with include_usage)."""
        return self.include_usage and bool(self.stream_options.get("continuous_usage_stats"))

    def sampling(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                 choice: int = 0) -> SamplingParams:
        """The engine's parameters for choice `choice` of n (a seeded request's choices draw
        from seed, seed + 1, ...: reproducible, and not all alike); RequestError naming the
        parameter if one is out of range."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=None if self.seed is None else self.seed + choice,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop=tuple(s for s in stop if s),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            min_tokens=self.min_tokens,
            grammar=self._grammar,
            cache_salt=self.cache_salt,
        )


class CompletionRequest(Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None  # (refused, as vLLM refuses it: no model here fills in the middle)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.prompt == "" or self.prompt == [] or any(p in ("", []) for p in self.prompts_raw()):
            raise ValueError("prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 only makes sense with echo=true (scoring the prompt)")
        return self

    @property
    def score_only(self) -> bool:
        """echo with max_tokens=0: score the prompt, generate nothing."""
        return self.max_tokens == 0

    def prompts_raw(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class ContentPart(BaseModel):
    """One part of a message's content; only text parts: the model reads nothing else."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported: this model reads text only")
        if self.text is None:
            raise ValueError("a text part needs its text")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it: text parts joined by newlines, the
        developer role as system (templates know that one), null content kept only
        beside tool calls (templates test for it there) and empty otherwise."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        if content is None and not self.tool_calls:
            content = ""
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        extra = {"name": self.name, "tool_calls": self.tool_calls, "tool_call_id": self.tool_call_id}
        return message | {k: v for k, v in extra.items() if v is not None}


class ChatRequest(Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    # Change how the server renders the prompt: refused unless the operator trusts clients.
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.stream and self.prompt_logprobs is not None:  # (as vLLM: a chunk has no place for them)
            raise ValueError("prompt_logprobs are not available when stream is true")
        return self


def error_body(message: str, type_: str = "invalid_request_error", code: int | str | None = None,
               param: str | None = None) -> dict:
    # A message may quote the request (a field name, a model id); a lone surrogate there
    # could not be encoded as UTF-8, so it is written out as its escape.
    def printable(s: str | None) -> str | None:
        return s if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")

    return {"error": {"message": printable(message), "type": type_, "code": code, "param": printable(param)}}


@dataclass(frozen=True)
class Envelope:
    """What every response and chunk of one request carries: id, object, created, model."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> Envelope:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def __call__(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
