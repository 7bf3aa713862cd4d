"""POST /tokenize and /detokenize: the server's own tokenizer and chat template, for
clients that count or build prompts (vLLM's shapes)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from preload.worker.api.chat import prompt_text
from preload.worker.api.errors import ApiError
from preload.worker.api.protocol import ChatMessage
from preload.worker.api.serving import serving

router = APIRouter()


class TokenizeBase(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    add_special_tokens: bool | None = None


class TokenizePrompt(TokenizeBase):
    prompt: str


class TokenizeChat(TokenizeBase):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    tools: list[dict] | None = None
    chat_template: str | None = None  # refused unless trusted, as in chat completions
    chat_template_kwargs: dict | None = None


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(req: TokenizePrompt | TokenizeChat, request: Request):
    s = serving(request)
    s.check_model(req.model)
    if isinstance(req, TokenizeChat):  # as chat completions render it: the template adds the special tokens
        ids = s.encode(prompt_text(s, req), "messages", add_special_tokens=bool(req.add_special_tokens))
    else:
        ids = s.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens is not False)
    return {"count": len(ids), "max_model_len": s.engine.stats().max_model_len, "tokens": ids, "token_strs": None}


@router.post("/detokenize")
async def detokenize(req: Detokenize, request: Request):
    s = serving(request)
    s.check_model(req.model)
    vocab = s.tokenizer.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
    return {"prompt": s.tokenizer.decode(req.tokens)}

