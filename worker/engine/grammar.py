"""Structured output: a request's grammar (a JSON schema, a regex or a choice of strings,
compiled by llguidance) held as
a matcher per sequence, which says which tokens may come next and follows each token
drawn. The sampler masks every other token (sampler.steer), so an output the grammar
finished always parses.

A grammar is refused when compiled, at a request's admission, unless it can start an
output (`problem`). llguidance reads the checkpoint's own tokenizer.json (no
transformers), and is imported only when a request asks for structured output.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

from preload.checkpoint.tokenizer import Tokenizer
from preload.worker.engine.sampling_params import RequestError


def json_schema_grammar(schema: dict) -> str:
    """The llguidance grammar of a JSON schema, compact (no free whitespace, which a
    model would otherwise be allowed to emit without end) and `closed`; ValueError if it
    is not one."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(closed(schema), defaults={"whitespace_flexible": False})
    except Exception as e:  # noqa: BLE001 - llguidance says what is wrong in its message
        raise ValueError(f"not a JSON schema llguidance can follow: {e}") from None
    return checked(grammar, "schema")


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


def regex_grammar(pattern: str, what: str = "regex") -> str:
    """The llguidance grammar of a regular expression; ValueError if it is not one."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_regex(pattern)
    except Exception as e:  # noqa: BLE001 - llguidance says what is wrong in its message
        raise ValueError(f"not a regex llguidance can follow: {e}") from None
    return checked(grammar, what)


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of `choices`."""
    if not choices:
        raise ValueError("choice needs at least one string")
    return regex_grammar("(" + "|".join(re.escape(c) for c in choices) + ")", "choice")


def checked(grammar: str, what: str) -> str:
    """`grammar` (of a `what`: schema, regex, choice) if it can start an output, else
    ValueError naming why not (problem)."""
    error = problem(grammar, what)
    if error:
        raise ValueError(error)
    return grammar


@lru_cache(maxsize=256)  # once per distinct grammar: clients send the same schema again and again
def problem(grammar: str, what: str) -> str | None:
    """What keeps `grammar` from starting an output, or None. Beyond llguidance's own
    validation, a grammar that compiles may still match no text at all (a schema that
    only refers to itself), or exceed llguidance's limits as soon as it runs (the regex
    (a{1000}){1000}): in the engine, the first ends its output at once, empty, and the
    second fails the request after seconds of work. So its first step is taken here, at
    admission, where the request is still the client's to fix."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:  # its first line, and the line that says what is wrong if it is another
        lines = [line.strip() for line in error.strip().splitlines()]
        return " ".join(lines[:1] + [line for line in lines[1:] if line.startswith("error:")])
    reason = first_step_error(grammar)
    if reason in NO_TEXT:
        return f"no text matches this {what}, so no output could follow it (llguidance: {reason})"
    if reason:
        return f"this {what} is too complex to follow: llguidance: {reason}"
    return None


NO_TEXT = ("NoExtension", "NoExtensionBias")  # llguidance's reasons when nothing may come first, not even the end


def first_step_error(grammar: str) -> str | None:
    """llguidance's reason why `grammar` cannot take its first step, or None: a matcher
    over a tokenizer of single bytes computes its first mask and takes the first byte it
    allows. Whether any text matches is the grammar's own property, which any tokenizer
    shows; the byte one costs well under a millisecond for the usual schema, where the
    model's (up to 128k tokens, in the engine) would cost more. Its limits are the
    engine's (Grammars.matcher): `limits`."""
    from llguidance import LLMatcher

    matcher = LLMatcher(byte_tokenizer(), grammar, log_level=0, limits=limits())
    first = allowed(matcher, BYTES + 1)[:BYTES].nonzero().flatten()
    if not matcher.is_error() and (len(first) == 0 or matcher.consume_token(int(first[0]))):
        return None  # (no byte but the end allowed: the one text it matches is empty, a fine output)
    # A lexer over its limits says so only once a token is consumed. The message's first
    # line is the reason, the rest a dump of the matcher's state.
    return matcher.get_error().strip().splitlines()[0]


BYTES = 256  # byte_tokenizer's tokens; its end-of-text token is the next id

# llguidance's fuel (its units: ~50k/ms building a lexer, ~14k/ms a mask step), a fifth and a
# half of its defaults: a grammar's first step at admission then costs at most tens of ms of
# the front's event loop, and a mask at most ~7 ms of an engine step, which every other
# sequence in the batch waits for. With the defaults, the regex (a{1000}){1000} took 0.48 s to
# be refused, and a{100000} cost 20-30 ms a token; now 0.055 s and 0.026 s, both refused as too
# complex (a{10000}: 4 ms, served; the usual schema: 2 ms).
LEXER_FUEL, STEP_FUEL = 200_000, 100_000


@lru_cache(maxsize=1)
def limits():
    from llguidance import LLParserLimits

    return LLParserLimits(initial_lexer_fuel=LEXER_FUEL, step_lexer_fuel=STEP_FUEL)


@lru_cache(maxsize=1)
def byte_tokenizer():
    """An llguidance tokenizer whose tokens are the 256 bytes, and an end token."""
    from llguidance import LLTokenizer, TokenizerWrapper

    class Bytes:
        eos_token_id, bos_token_id = BYTES, None
        tokens = [bytes([b]) for b in range(BYTES)] + [b"<end>"]
        special_token_ids = [BYTES]

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    return LLTokenizer(TokenizerWrapper(Bytes()))


class GrammarsUnavailable(RequestError):
    """llguidance cannot read this model's tokenizer (one without a decoder it knows, such as
    `preload make-checkpoint`'s word-level one), so no grammar can be followed: a request
    that asks for one hears why, as a 400 (vLLM's answer to what a deployment cannot do)."""


class Grammars:
    """Matchers for one engine's sequences, over its tokenizer and the model's vocabulary
    (ids beyond the tokenizer's are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, stop_ids: frozenset[int]):
        self.tokenizer, self.vocab, self.stop_ids = tokenizer, vocab, stop_ids
        self._ll = None
        self._unreadable: str | None = None  # why llguidance cannot read the tokenizer, once it has tried

    def matcher(self, grammar: str):
        """GrammarsUnavailable if no grammar can be followed with this tokenizer."""
        from llguidance import LLMatcher, LLTokenizer

        if self._ll is None and self._unreadable is None:  # once per engine: about a second for a 128k vocabulary
            try:
                self._ll = LLTokenizer(self.tokenizer.hf.to_str(), n_vocab=self.vocab, eos_token=sorted(self.stop_ids))
            except Exception as e:  # noqa: BLE001 - llguidance says why in its message
                self._unreadable = ("structured output is not available for this model: llguidance cannot read"
                                    f" its tokenizer ({e})")
        if self._unreadable is not None:
            raise GrammarsUnavailable(self._unreadable)
        return LLMatcher(self._ll, grammar, limits=limits())


def allowed(matcher, vocab: int) -> torch.Tensor:
    """The tokens `matcher` allows next, as a bool mask [vocab] (on the host). (Filled as
    llguidance.torch fills it, without importing that module: it imports torch's compiler,
    seconds of a first request's time.)"""
    bits = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * bits.element_size())
    return ((bits[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()[:vocab]
