"""The body of POST /v1/responses (OpenAI's Responses API), read as chat reads its own.

`instructions` and `input` (a string, or items: messages with text parts, earlier function
calls and their outputs) become chat messages; function `tools` and `tool_choice` become
chat's; `text.format` becomes `response_format`; `max_output_tokens` is max_tokens. The
sampling fields and vLLM's extensions are those of every request (protocol.Request).

Nothing is stored, so what would need a stored response is refused rather than ignored:
`previous_response_id`, `background`, `conversation` (a 400 saying to send the whole
conversation); `store` is accepted and the response says `store: false`. Items and tools
the model cannot use (images, files, built-in tools such as web search) are refused too.
"""

from __future__ import annotations

import json
from pydantic import model_validator

from preload.worker.api.protocol import Request

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(Request):
    # What the body says in chat's terms, made once by _check (chat.py's render, tool_choice)
    _messages: list[dict] = []
    _chat_tools: list[dict] | None = None
    _chat_tool_choice: str | dict | None = None

    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    store: bool = True  # (nothing is stored: the response says store: false)
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    background: bool = False
    conversation: str | dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_format(cls, data):
        """text.format, as the response_format every request knows (protocol.Request)."""
        if isinstance(data, dict) and isinstance(data.get("text"), dict) and data["text"].get("format") is not None:
            if data.get("response_format") is not None:
                raise ValueError("text.format and response_format: send one of them")
            data = {**data, "response_format": response_format(data["text"]["format"])}
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: this server stores no responses; send the whole conversation as input")
        if self.background:
            raise ValueError("background: this server stores no responses to fetch later; use stream instead")
        if self.input == []:
            raise ValueError("input must not be empty")
        if self.n != 1:
            raise ValueError("n: a response has one output")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: a response has no place for them; use /v1/completions")
        self._messages = conversation(self.instructions, self.input)
        self._chat_tools = [chat_tool(i, t) for i, t in enumerate(self.tools or ())] or None
        self._chat_tool_choice = chat_tool_choice(self.tool_choice)
        return self

    @property
    def messages(self) -> list[dict]:
        return self._messages

    @property
    def chat_tools(self) -> list[dict] | None:
        return self._chat_tools

    @property
    def chat_tool_choice(self) -> str | dict | None:
        return self._chat_tool_choice

    @property
    def text_format(self) -> dict:
        return (self.text or {}).get("format") or {"type": "text"}


def response_format(fmt) -> dict:
    """Responses' text.format ({"type": "json_schema", "name", "schema", "strict"}, flat) as
    chat's response_format ({"type": "json_schema", "json_schema": {"name", "schema"}})."""
    if not isinstance(fmt, dict):
        raise ValueError("text.format: an object with a type")
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}


def conversation(instructions: str | None, items: str | list[dict]) -> list[dict]:
    """The chat messages (as templates read them) that `instructions` and `input` say;
    ValueError naming the item at fault."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise ValueError(f"input[{i}].role: one of {', '.join(ROLES)}, got {role!r}")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": message_text(f"input[{i}].content", item.get("content"))})
        elif kind == "function_call":
            call = {"id": field(item, i, "call_id"), "type": "function",
                    "function": {"name": field(item, i, "name"), "arguments": field(item, i, "arguments")}}
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and last.get("tool_calls"):  # parallel calls: one assistant turn
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": field(item, i, "call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind != "reasoning":  # (earlier thinking is not shown to the model again, as R1's template drops it)
            raise ValueError(f"input[{i}]: items of type {kind!r} are not supported")
    return messages


def field(item: dict, i: int, name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ValueError(f"input[{i}].{name}: a string")
    return value


def message_text(where: str, content) -> str:
    """A message's text: the string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}]: parts of type {kind!r} are not supported: this model reads text only")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tool(i: int, tool: dict) -> dict:
    """A Responses function tool ({"type": "function", "name", "parameters", ...}) as chat's."""
    if tool.get("type") != "function":
        raise ValueError(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported; function tools only")
    if not isinstance(tool.get("name"), str):
        raise ValueError(f"tools[{i}].name: a string")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """Responses' {"type": "function", "name": N} as chat's; the strings are the same."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise ValueError(f"tool_choice of type {choice.get('type')!r} is not supported; function tools only")
    return {"type": "function", "function": {"name": choice.get("name")}}
