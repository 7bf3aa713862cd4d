"""Request and response shapes of the OpenAI-compatible API.

pydantic checks the shape of a request (types, strictly: `true` is not the number 1,
and token ids are not booleans); the ranges of the sampling parameters are checked in
one place below the API, SamplingParams, whose RequestError names the parameter.

Unknown fields are rejected rather than ignored: a client that believes it changed
how the server processes its request (a template, template kwargs, an option we
do not implement) must hear that it did not.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from preload.worker.engine.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: Literal[1] = 1
    stream: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream_options: dict[Literal["include_usage"], bool] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling(self, max_tokens: int, logprobs: int | None, prompt_logprobs: bool) -> SamplingParams:
        """The engine's parameters (RequestError naming the parameter if one is out of range)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )


class CompletionRequest(Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    # Change how the server renders the prompt: refused unless the operator trusts clients.
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
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


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
