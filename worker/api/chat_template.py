"""Rendering a conversation into prompt text with the checkpoint's jinja chat template.

Templates run in jinja2's immutable sandbox: a template (the checkpoint's, or one a
trusted client sends) cannot reach Python internals or mutate its inputs.
"""

from __future__ import annotations

import json
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


@lru_cache(maxsize=16)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message: str):
        raise ChatTemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Templates are written against transformers' tojson (what vLLM renders with): keys
        # in their order, text as it is; jinja2's own sorts keys and escapes <, >, &, '.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    return env.from_string(source)


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool, **variables) -> str:
    if not template:
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
