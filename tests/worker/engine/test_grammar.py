"""Structured-output grammars (worker/engine/grammar.py) are refused when compiled, at a
request's admission, if they cannot start an output: one that no text matches (a schema
that only refers to itself) would end every output at once, empty; one over llguidance's
limits as soon as it runs (the regex (a{1000}){1000}) would fail the request mid-way.
Each is a ValueError (a 400 at the API) naming what is wrong; grammars that can start
still compile, the empty text included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preload import BUNDLED_MODEL
from preload.checkpoint.tokenizer import Tokenizer
from preload.worker.engine import grammar as g
from preload.worker.engine.grammar import Grammars, allowed, choice_grammar, json_schema_grammar, regex_grammar

SELF = {"$ref": "#"}  # refers only to itself: no JSON value is one
PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}}}
TOO_COMPLEX = "(a{1000}){1000}"  # a million forced bytes: llguidance's lexer runs out of fuel on the first one


LOOP = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize("schema", [SELF, {"allOf": [SELF]}, LOOP], ids=["self", "all-of-self", "loop"])
def test_a_schema_no_text_matches_is_refused(schema):
    with pytest.raises(ValueError, match="no text matches this schema.*NoExtensionBias"):
        json_schema_grammar(schema)


def test_a_regex_no_text_matches_is_refused():
    with pytest.raises(ValueError, match="no text matches this regex"):
        regex_grammar(r"[^\s\S]")


@pytest.mark.parametrize("compile_", [lambda: regex_grammar(TOO_COMPLEX),
                                      lambda: json_schema_grammar({"type": "string", "pattern": f"^{TOO_COMPLEX}$"}),
                                      lambda: choice_grammar(["a" * 1_000_000])], ids=["regex", "pattern", "choice"])
def test_a_grammar_over_llguidances_limits_is_refused_with_its_message(compile_):
    with pytest.raises(ValueError, match="too complex to follow: llguidance: lexer error: too many expressions"):
        compile_()


def test_the_servers_limits_refuse_what_would_stall_every_step_and_keep_the_rest():
    """The fuel the engine's matchers get (grammar.limits): a repetition whose every mask
    cost 20-30 ms of each engine step (a{100000}) is refused as too complex; one ten times
    shorter, served."""
    with pytest.raises(ValueError, match="too complex to follow"):
        regex_grammar("a{100000}")
    assert regex_grammar("a{10000}")


def test_syntax_errors_name_the_error_not_only_where():
    with pytest.raises(ValueError, match="regex parse error.*unclosed group"):
        regex_grammar("(")
    with pytest.raises(ValueError, match="decimal literal invalid"):
        json_schema_grammar({"type": "string", "minLength": 10**12})


@pytest.mark.parametrize("compile_", [
    lambda: json_schema_grammar(PERSON),
    lambda: json_schema_grammar({"type": "object"}),
    lambda: json_schema_grammar({"type": "object", "properties": {"kids": {"type": "array", "items": SELF}}}),  # a tree
    lambda: json_schema_grammar({"anyOf": [SELF, {"type": "null"}]}),
    lambda: regex_grammar("[0-9]{3}-[a-c]"),
    lambda: regex_grammar("a{1000}"),
    lambda: choice_grammar(["yes", "no"]),
    lambda: regex_grammar(""),  # the empty text is an output: only the end may come
    lambda: choice_grammar([""]),
], ids=["person", "object", "tree", "self-or-null", "regex", "long-regex", "choice", "empty-regex", "empty-choice"])
def test_grammars_that_can_start_still_compile(compile_):
    assert compile_()


def test_the_check_runs_once_per_distinct_grammar():
    grammar = json_schema_grammar(PERSON)
    before = g.problem.cache_info()
    assert json_schema_grammar(PERSON) == grammar
    after = g.problem.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


def test_what_is_refused_is_what_fails_over_the_models_own_tokenizer():
    """The check runs over a tokenizer of bytes; over the model's tokenizer, in the engine,
    the schema no text matches is an error at the first mask too, with only the end
    allowed: the empty output the check keeps from being answered 200."""
    from llguidance import LLMatcher

    config = json.loads((Path(BUNDLED_MODEL) / "config.json").read_text())
    eos = config["eos_token_id"]
    grammars = Grammars(Tokenizer.from_dir(BUNDLED_MODEL), config["vocab_size"], frozenset([eos]))
    raw = LLMatcher.grammar_from_json_schema(SELF, defaults={"whitespace_flexible": False})  # (not checked)
    matcher = grammars.matcher(raw)
    assert allowed(matcher, config["vocab_size"]).nonzero().flatten().tolist() == [eos]
    assert matcher.is_error() and g.first_step_error(raw) == matcher.get_error().splitlines()[0]
    matcher = grammars.matcher(json_schema_grammar(PERSON))
    assert allowed(matcher, config["vocab_size"]).any() and not matcher.is_error()


def test_a_tokenizer_llguidance_cannot_read_refuses_every_grammar_saying_why():
    """`preload make-checkpoint`'s word-level tokenizer has no decoder llguidance knows: a
    grammar request on such a model is refused naming llguidance's reason (a 400 from the
    core: tests/worker/test_core.py), each time, not left without an answer."""
    from preload.bench.checkpoint import word_level_tokenizer

    grammars = Grammars(Tokenizer(*word_level_tokenizer(300, None, 2)), 300, frozenset({2}))
    for _ in range(2):
        with pytest.raises(g.GrammarsUnavailable, match="llguidance cannot read its tokenizer .*decoder"):
            grammars.matcher(regex_grammar("[a-z]+"))
