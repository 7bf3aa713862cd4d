"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Unknown fields are rejected rather than ignored: a client that believes it changed
how the server processes its request (a template, template kwargs, an option we
do not implement) must hear that it did not.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from preload.worker.engine.sampler import SamplingParams

MAX_TOKENS_LIMIT = 1 << 20


class Request(BaseModel):
    # strict: `true` is not the number 1, and token ids are not booleans.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    n: Literal[1] = 1
    stream: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None
    stream_options: dict[Literal["include_usage"], bool] | None = None

    def sampling(self, max_tokens: int, logprobs: int | None, prompt_logprobs: bool) -> SamplingParams:
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
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.prompt == "" or self.prompt == [] or any(p in ("", []) for p in self.prompts_raw()):
            raise ValueError("prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 only makes sense with echo=true (scoring the prompt)")
        return self

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
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    add_generation_prompt: bool = True
    # Change how the server renders the prompt: refused unless the operator trusts clients.
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


def error_body(message: str, type_: str = "invalid_request_error", code: int | str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}
