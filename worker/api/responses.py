"""POST /v1/responses: OpenAI's Responses API, over what chat does.

The body (responses_request.py) becomes a conversation rendered with the chat template,
with chat's tools and structured output; the reply is read apart as chat reads it
(chat.ChoiceText: reasoning, content, tool calls) and written as Responses' output items:
a `reasoning` item, a `message` with its `output_text`, `function_call`s. A stream is
Responses' typed events (`event:` and `data:` lines, each with its sequence_number):
response.created, response.in_progress, then per item output_item.added, its part and
deltas, their .done events and output_item.done, and last response.completed (or
response.incomplete when max_output_tokens ended it; response.failed if the engine
failed it). Whole or streamed, the items are built the same way (`ResponseWriter`).
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from preload.worker.api import reasoning
from preload.worker.api.chat import ChoiceText, render, tool_choice, with_tools
from preload.worker.api.responses_request import ResponsesRequest
from preload.worker.api.serving import Serving, serving
from preload.worker.api.tools import ToolChoice
from preload.worker.engine.output import Output
from preload.worker.engine.sampling_params import RequestError
from preload.worker.engine.sequence import Sequence

router = APIRouter()


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request):
    s = serving(request)
    arrived = time.monotonic()
    s.admit(req, request)
    tools = tool_choice(s, req.chat_tools, req.chat_tool_choice, req.has_grammar)
    prompt = s.encode(render(s, req.messages, req.chat_tools, "input"), "input", add_special_tokens=False)
    max_tokens = req.max_output_tokens
    if max_tokens is None:  # (to the end of the context, as chat without max_tokens)
        max_tokens = max(1, s.engine.stats().max_model_len - len(prompt))
    try:
        params = req.sampling(max_tokens, None, prompt_logprobs=None)
    except RequestError as e:
        raise RequestError(str(e).replace("max_tokens", "max_output_tokens"),
                           "max_output_tokens" if e.param == "max_tokens" else e.param) from None
    seq = Sequence(prompt, with_tools(params, tools, s.tool_parser))
    [outputs] = s.submit([seq], arrived)
    writer = ResponseWriter(s, req, seq, tools)
    if req.stream:
        return StreamingResponse(writer.events(outputs), media_type="text/event-stream")
    [out] = await s.collect(request, [outputs])
    writer.add(out)
    return writer.response()


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class ResponseWriter:
    """One response: its output items, built from the sequence's Outputs as they come
    (`add`, which returns the stream's events for them), and the Response object."""

    def __init__(self, s: Serving, req: ResponsesRequest, seq: Sequence, tools: ToolChoice):
        self.s, self.req, self.seq = s, req, seq
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        grammar = tools.grammar is not None or req.has_grammar
        self.text = ChoiceText(tools, s.tool_parser, s.options.reasoning_parser, grammar)
        self.items: list[dict] = []  # the output so far; the last may still be open
        self.open: dict | None = None
        self.events_sent = 0
        self.token_ids: list[int] = []
        self.cached = 0
        self.finish_reason: str | None = None

    async def events(self, outputs):
        """The stream: every event of the response, the last saying how it ended."""
        yield self._event("response.created", response=self.response("in_progress"))
        yield self._event("response.in_progress", response=self.response("in_progress"))
        try:
            async for out in outputs:
                for event in self.add(out):
                    yield event
        except Exception as e:  # noqa: BLE001 - the headers are sent: report it in the stream
            failed = self.response("failed") | {"error": {"code": "server_error", "message": str(e)}}
            yield self._event("response.failed", response=failed)
            return
        finally:
            await outputs.aclose()  # a client gone: the engine aborts the sequence
        done = self.response()
        yield self._event(f"response.{done['status']}", response=done)

    def add(self, out: Output) -> list[str]:
        """Take the next Output; the events it makes."""
        self.token_ids += out.token_ids
        if out.cached_tokens is not None:
            self.cached = out.cached_tokens
        delta = self.text.delta(out.text, out.finished)
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            events += self._call(call)
        if out.finished:
            self.finish_reason = out.finish_reason
            events += self._close()
        return events

    def response(self, status: str | None = None) -> dict:
        """The Response object: as it ends (its status from the finish reason), or in
        `status` ("in_progress": no output yet)."""
        if status is None:
            status = "incomplete" if self.finish_reason == "length" else "completed"
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "model": self.s.model_name,
            "output": self.items if status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None, "reasoning": None,
            "store": False, "temperature": req.temperature, "text": {"format": req.text_format},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
            "truncation": "disabled", "user": req.user,
            "usage": None if status == "in_progress" else self._usage(),
        }

    def _usage(self) -> dict:
        prompt, output = len(self.seq.prompt), len(self.token_ids)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": self.cached},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
                "total_tokens": prompt + output}

    def _reasoning_tokens(self) -> int:
        """Output tokens up to the end of the thinking (all if it never ended): the fewest
        whose text holds </think>, found by halving (the text of a prefix only grows)."""
        if not self.text.thinks or not any(item["type"] == "reasoning" for item in self.items):
            return 0
        ids, skip = self.token_ids, self.seq.params.skip_special_tokens
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if reasoning.END in self.s.tokenizer.decode(ids[: mid + 1], skip_special_tokens=skip):
                hi = mid
            else:
                lo = mid + 1
        return min(lo + 1, len(ids))

    def _event(self, kind: str, **fields) -> str:
        self.events_sent += 1
        return sse({"type": kind, "sequence_number": self.events_sent - 1, **fields})

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict) -> list[str]:
        events = self._close()
        self.open = item
        self.items.append(item)
        return events + [self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _text(self, kind: str, piece: str) -> list[str]:
        """Text of a message or of reasoning, opening an item of that kind if need be."""
        events = []
        if self.open is None or self.open["type"] != kind:
            prefix = "msg" if kind == "message" else "rs"
            item = {"id": f"{prefix}_{uuid.uuid4().hex}", "type": kind, "status": "in_progress", "content": []}
            item |= {"role": "assistant"} if kind == "message" else {"summary": []}
            events += self._start(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} if kind == "message" \
                else {"type": "reasoning_text", "text": ""}
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
            item["content"].append(part)
        self.open["content"][0]["text"] += piece
        extra = {"logprobs": []} if kind == "message" else {}
        name = "output_text" if kind == "message" else "reasoning_text"
        return events + [self._event(f"response.{name}.delta", **self._where(), content_index=0, delta=piece, **extra)]

    def _call(self, delta: dict) -> list[str]:
        """A tool-call delta of chat's (tools.ToolStream): a new call has an id and a name."""
        events = []
        fn = delta.get("function") or {}
        if "id" in delta:
            events += self._start({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                                   "call_id": delta["id"], "name": fn["name"], "arguments": ""})
        if fn.get("arguments"):
            self.open["arguments"] += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta", **self._where(),
                                      delta=fn["arguments"]))
        return events

    def _close(self) -> list[str]:
        """The .done events of the open item, if any."""
        item = self.open
        if item is None:
            return []
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **self._where(),
                                      name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            name = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(self._event(f"response.{name}.done", **self._where(), content_index=0,
                                      text=part["text"], **extra))
            events.append(self._event("response.content_part.done", **self._where(), content_index=0, part=part))
        item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        events.append(self._event("response.output_item.done", output_index=len(self.items) - 1, item=item))
        self.open = None
        return events

