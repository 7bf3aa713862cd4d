"""What a request's structured-output fields ask for, as one grammar (engine/grammar.py):
OpenAI's `response_format` (json_object, json_schema) or vLLM's `structured_outputs`
({"json": schema} | {"regex": pattern} | {"choice": [strings]}) and its older spellings
`guided_json`, `guided_regex`, `guided_choice`. One kind at a time."""

from __future__ import annotations

from preload.worker.engine.grammar import choice_grammar, json_schema_grammar, regex_grammar

KINDS = ("json", "regex", "choice")


def grammar_of(response_format: dict | None, structured_outputs: dict | None, guided_json: dict | None,
               guided_regex: str | None, guided_choice: list[str] | None) -> str | None:
    """The grammar the output must follow, or None for free text; ValueError naming what
    is wrong (a 400 through the request's validation)."""
    asked = {k: v for k, v in (structured_outputs or {}).items() if v is not None}
    asked |= {k: v for k, v in zip(KINDS, (guided_json, guided_regex, guided_choice)) if v is not None}
    unknown = sorted(set(asked) - set(KINDS))
    if unknown:
        raise ValueError(f"structured_outputs: json, regex or choice, not {unknown}")
    fmt = response_format or {"type": "text"}
    kinds = list(asked) + (["response_format"] if fmt.get("type") != "text" else [])
    if len(kinds) > 1:
        raise ValueError(f"one kind of structured output at a time, got {', '.join(kinds)}")
    try:
        if "json" in asked:
            if not isinstance(asked["json"], dict):
                raise ValueError("json: a JSON schema object")
            return json_schema_grammar(asked["json"])
        if "regex" in asked:
            if not isinstance(asked["regex"], str):
                raise ValueError("regex: a string")
            return regex_grammar(asked["regex"])
        if "choice" in asked:
            if not (isinstance(asked["choice"], list) and all(isinstance(c, str) for c in asked["choice"])):
                raise ValueError("choice: a list of strings")
            return choice_grammar(asked["choice"])
    except ValueError as e:
        raise ValueError(f"structured output: {e}") from None
    return response_format_grammar(fmt)


def response_format_grammar(fmt: dict) -> str | None:
    """response_format: json_object, any JSON object; json_schema, that schema; text, None."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind != "json_schema":
        raise ValueError(f"response_format type {kind!r}: text, json_object or json_schema")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ValueError("response_format json_schema needs json_schema.schema, an object")
    try:
        return json_schema_grammar(schema)
    except ValueError as e:
        raise ValueError(f"response_format: {e}") from None
