"""Tool calling, as vLLM serves it to the OpenAI SDK.

What a request's `tools` and `tool_choice` ask (`ToolChoice.of`):
- "none": the tools are rendered into the prompt (the chat template's business), and the
  reply is text;
- a named function ({"type": "function", "function": {"name": N}}): the output is held by
  the grammar engine to N's parameters schema, and is N's arguments (finish_reason "stop",
  as OpenAI's forced calls end);
- "required": the output is held to a JSON array of one call or more, each
  {"name": one of the tools, "parameters": its schema} (vLLM's format for it);
- "auto" (what the SDK sends whenever there are tools): the model writes calls in its own
  format if it wants to, and a parser finds them in the text (`--enable-auto-tool-choice
  --tool-call-parser NAME`; without them, a 400 as in vLLM).

Parsers (`PARSERS`): "hermes", calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>
(any model can be asked to write those); "deepseek_v3", the format DeepSeek-V3's and R1's
chat templates render: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
then the arguments in a ```json block, <｜tool▁call▁end｜>, ..., <｜tool▁calls▁end｜>.

A reply's tool calls come out whole in a response, and in a stream as the SDK reads them:
a named call's arguments streamed as they are written; "required" and "auto" calls once
their text is complete (auto streams the text before the first call as content, holding
back what could be the start of one).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from preload.worker.api.markers import unmarked_end
from preload.worker.engine.grammar import json_schema_grammar


class ToolError(ValueError):
    """What is wrong with a request's tools (a 400 naming `param`)."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


def call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "named", "required" or "auto"
    name: str | None = None  # the named function
    grammar: str | None = None  # what holds the output (named, required)

    @classmethod
    def of(cls, tools: list[dict] | None, choice: str | dict | None, parser: str | None) -> ToolChoice:
        """The request's ask; `parser`: the operator's --tool-call-parser (None: auto is refused)."""
        if not tools:
            if choice not in (None, "none"):
                raise ToolError("tool_choice needs tools", "tool_choice")
            return cls("none")
        functions = {}
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ToolError('each tool is {"type": "function", "function": {"name": ..., "parameters": ...}}')
            functions[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
        if choice == "none":
            return cls("none")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in functions:
                raise ToolError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
            return cls("named", name, _grammar(functions[name], name))
        if choice == "required":
            items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": schema},
                      "required": ["name", "parameters"]} for n, schema in functions.items()]
            return cls("required", grammar=_grammar({"type": "array", "minItems": 1, "items": {"anyOf": items}}, "required"))
        if choice not in (None, "auto"):
            raise ToolError(f"tool_choice {choice!r}: none, auto, required or a named function", "tool_choice")
        if parser is None:
            raise ToolError('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                            '--tool-call-parser', "tool_choice")
        return cls("auto")

    def calls(self, text: str, parser: str | None) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole reply."""
        if self.mode == "named":
            return None, [call(self.name, text)]
        if self.mode == "required":
            try:
                return None, [call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
            except (ValueError, KeyError, TypeError):  # (cut short by max_tokens: not whole JSON)
                return text, []
        if self.mode == "auto":
            return PARSERS[parser].parse(text)
        return text, []


def _grammar(schema: dict, what: str) -> str:
    try:
        return json_schema_grammar(schema)
    except ValueError as e:
        raise ToolError(f"{what}: its parameters are not a JSON schema the grammar engine takes: {e}") from None


class Hermes:
    START, END = "<tool_call>", "</tool_call>"
    SPECIAL = False  # (its markers are plain text)
    BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    @classmethod
    def parse(cls, text: str) -> tuple[str | None, list[dict]]:
        calls = []
        for body in cls.BLOCK.findall(text):
            try:
                obj = json.loads(body)
                calls.append(call(obj["name"], json.dumps(obj.get("arguments", {}))))
            except (ValueError, KeyError, TypeError):
                return text, []  # not calls after all: the text as it is
        if not calls:
            return text, []
        content = cls.BLOCK.sub("", text).strip()
        return content or None, calls


class DeepSeekV3:
    START, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    SPECIAL = True  # (special tokens of DeepSeek's tokenizer: the text must keep them)
    CALL = re.compile(r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(.*?)\n```(?:json)?\n(.*?)\n```<｜tool▁call▁end｜>",
                      re.DOTALL)

    @classmethod
    def parse(cls, text: str) -> tuple[str | None, list[dict]]:
        if cls.START not in text:
            return text, []
        head, _, rest = text.partition(cls.START)
        calls = []
        for name, arguments in cls.CALL.findall(rest):
            try:
                calls.append(call(name.strip(), json.dumps(json.loads(arguments))))
            except ValueError:
                return text, []
        if not calls:
            return text, []
        return head.strip() or None, calls


PARSERS = {"hermes": Hermes, "deepseek_v3": DeepSeekV3}


class ToolStream:
    """One choice's stream: what each piece of text adds to the reply's delta. `delta(text,
    last)` -> (content to send, tool-call deltas to send)."""

    def __init__(self, choice: ToolChoice, parser: str | None):
        self.choice, self.parser = choice, parser
        self.text = ""  # all of it, for the calls at the end
        self.shown = 0  # characters of it sent as content
        self.named_started = False

    def delta(self, piece: str, last: bool) -> tuple[str, list[dict]]:
        mode = self.choice.mode
        self.text += piece
        if mode == "none":
            return piece, []
        if mode == "named":
            deltas = []
            if not self.named_started:
                self.named_started = True
                c = call(self.choice.name, "")
                deltas.append({"index": 0, **c})
            if piece:
                deltas.append({"index": 0, "function": {"arguments": piece}})
            return "", deltas
        if mode == "auto":
            start = PARSERS[self.parser].START
            cut = self.text.find(start)
            if cut < 0:  # no call yet: all but what could begin one
                cut = len(self.text) if last else unmarked_end(self.text, start)
            content = self.text[self.shown : max(cut, self.shown)]
            self.shown = max(cut, self.shown)
            if not last:
                return content, []
            rest, calls = self.choice.calls(self.text[self.shown :], self.parser)
            return content + (rest or "") if not calls else content, _indexed(calls)
        if not last:  # required: once whole
            return "", []
        content, calls = self.choice.calls(self.text, self.parser)
        return content or "", _indexed(calls)


def _indexed(calls: list[dict]) -> list[dict]:
    return [{"index": i, **c} for i, c in enumerate(calls)]
