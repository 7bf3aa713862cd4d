"""Structured output: a request's grammar (a JSON schema, a regex or a choice of strings,
compiled by llguidance) held as
a matcher per sequence, which says which tokens may come next and follows each token
drawn. The sampler masks every other token (sampler.steer), so an output the grammar
finished always parses.

llguidance reads the checkpoint's own tokenizer.json (no transformers), and is imported
only when a request asks for structured output.
"""

from __future__ import annotations

import re

import torch

from preload.checkpoint.tokenizer import Tokenizer


def json_schema_grammar(schema: dict) -> str:
    """The llguidance grammar of a JSON schema, compact (no free whitespace, which a
    model would otherwise be allowed to emit without end) and `closed`; ValueError if it
    is not one."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(closed(schema), defaults={"whitespace_flexible": False})
    except Exception as e:  # noqa: BLE001 - llguidance says what is wrong in its message
        raise ValueError(f"not a JSON schema llguidance can follow: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar


NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # maps of name -> schema
VALUES = ("const", "enum", "default", "examples")  # JSON values, not schemas


def closed(schema):
    """`schema` with every object that lists its properties and says nothing of others
    closed to others (additionalProperties false), as vLLM's default backend (xgrammar's
    strict mode) reads schemas: a tool's arguments then hold its parameters only, not
    keys a model invents (pydantic's and so LangChain's schemas never say)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in NAMED and isinstance(value, dict):
            out[key] = {name: closed(s) for name, s in value.items()}
        else:
            out[key] = value if key in VALUES else closed(value)
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in schema and not any(k in schema for k in open_keys):
        out["additionalProperties"] = False
    return out


def regex_grammar(pattern: str) -> str:
    """The llguidance grammar of a regular expression; ValueError if it is not one."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_regex(pattern)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error.strip().splitlines()[0])
    return grammar


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of `choices`."""
    if not choices:
        raise ValueError("choice needs at least one string")
    return regex_grammar("(" + "|".join(re.escape(c) for c in choices) + ")")


class Grammars:
    """Matchers for one engine's sequences, over its tokenizer and the model's vocabulary
    (ids beyond the tokenizer's are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, stop_ids: frozenset[int]):
        self.tokenizer, self.vocab, self.stop_ids = tokenizer, vocab, stop_ids
        self._ll = None

    def matcher(self, grammar: str):
        from llguidance import LLMatcher, LLTokenizer

        if self._ll is None:  # once per engine: about a second for a 128k vocabulary
            self._ll = LLTokenizer(self.tokenizer.hf.to_str(), n_vocab=self.vocab, eos_token=sorted(self.stop_ids))
        return LLMatcher(self._ll, grammar)


def allowed(matcher, vocab: int) -> torch.Tensor:
    """The tokens `matcher` allows next, as a bool mask [vocab] (on the host)."""
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    bits = allocate_token_bitmask(1, vocab)
    fill_next_token_bitmask(matcher, bits, 0)
    return ((bits[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()[:vocab]
