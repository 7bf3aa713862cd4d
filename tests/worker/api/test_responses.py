"""POST /v1/responses (OpenAI's Responses API) through the official `openai` SDK against a
real worker.

What is specified: a response is what chat completions answers for the same conversation
(`input` a string: one user message; items: messages with text parts, `instructions` as
the system message, the developer role as system), with Responses' usage (input_tokens
the chat's prompt_tokens, output_tokens, total, cached input tokens) and status
("incomplete", reason max_output_tokens, when the budget cut it; "completed" otherwise).
Streamed, it is Responses' typed events in their order, numbered 0, 1, 2, ..., whose text
deltas join to the response's text. Structured output through the SDK's
`responses.parse` / `responses.stream(text_format=...)`; function tools (a named
`tool_choice` gives a function_call item whose arguments follow the schema; a next turn
with function_call and function_call_output items is answered). What needs a stored
response, and what this model cannot read, is refused with a 400 naming the field; a
client that leaves mid-stream leaves nothing running; `store` is answered false.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import pytest
from daemons import total, wait_for
from openai import BadRequestError, OpenAI
from pydantic import BaseModel
from workers import bundled_model_ready, one_worker

pytestmark = pytest.mark.skipif(not bundled_model_ready(), reason="needs the bundled model (it writes Python)")

PROMPT = "def fibonacci(n):"
MAX = 12  # output tokens of most requests here
EOS = 1  # the bundled tokenizer's <|end|>


@pytest.fixture(scope="module")
def worker(model, tmp_path_factory):
    with one_worker(model, tmp_path_factory, "responses") as w:
        yield w


@pytest.fixture(scope="module")
def client(worker) -> OpenAI:
    return OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def name(client) -> str:
    return client.models.list().data[0].id


def greedy_response(client, name, input, max_output_tokens=MAX, extra=None, **kw):
    return client.responses.create(model=name, input=input, temperature=0, max_output_tokens=max_output_tokens,
                                   extra_body={"ignore_eos": True} | (extra or {}), **kw)


def greedy_chat(client, name, messages, max_tokens=MAX, extra=None, **kw):
    return client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=max_tokens,
                                          extra_body={"ignore_eos": True} | (extra or {}), **kw)


def assert_same_answer(response, chat):
    """A response and a chat completion of the same conversation say the same."""
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


# ---- whole responses ----------------------------------------------------------------------


def test_a_string_input_is_answered_as_chat_answers_one_user_message(client, name):
    r = greedy_response(client, name, PROMPT)
    chat = greedy_chat(client, name, [{"role": "user", "content": PROMPT}])
    assert r.object == "response" and r.model == name and r.id.startswith("resp_")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    assert [part.type for part in item.content] == ["output_text"]
    assert r.output_text and r.output_text == item.content[0].text
    assert_same_answer(r, chat)
    assert r.usage.output_tokens == MAX
    cached = r.usage.input_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached < r.usage.input_tokens


def test_items_with_text_parts_and_instructions_are_the_chat_conversation(client, name):
    """`instructions` is the system message; a message's input_text parts are joined by
    newlines; an assistant's output_text is its turn; developer is system."""
    items = [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "import os"}, {"type": "input_text", "text": "import sys"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "import re"}]},
        {"role": "user", "content": PROMPT},
    ]
    r = greedy_response(client, name, items, instructions="You write Python.")
    chat = greedy_chat(client, name, [{"role": "system", "content": "You write Python."},
                                      {"role": "user", "content": "import os\nimport sys"},
                                      {"role": "assistant", "content": "import re"},
                                      {"role": "user", "content": PROMPT}])
    assert_same_answer(r, chat)
    assert r.instructions == "You write Python."

    dev = greedy_response(client, name, [{"role": "developer", "content": "You write Python."}] + items[2:])
    system = greedy_chat(client, name, [{"role": "system", "content": "You write Python."},
                                        {"role": "user", "content": PROMPT}])
    assert_same_answer(dev, system)


def test_a_response_cut_by_max_output_tokens_is_incomplete(client, name):
    r = greedy_response(client, name, PROMPT, max_output_tokens=5)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert r.usage.output_tokens == 5 and r.max_output_tokens == 5


def test_a_response_that_ends_itself_is_completed(client, name):
    """Three tokens (min_tokens bans the end token), then the end token, biased to +100."""
    r = client.responses.create(model=name, input=PROMPT, temperature=0, max_output_tokens=MAX,
                                extra_body={"min_tokens": 3, "logit_bias": {str(EOS): 100}})
    assert r.status == "completed" and r.incomplete_details is None
    assert r.output[0].status == "completed"
    assert r.usage.output_tokens == 4 < MAX
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}], temperature=0,
                                          max_tokens=MAX, extra_body={"min_tokens": 3, "logit_bias": {str(EOS): 100}})
    assert chat.choices[0].finish_reason == "stop"
    assert_same_answer(r, chat)


def test_store_is_answered_false(client, name):
    r = greedy_response(client, name, PROMPT, max_output_tokens=2, store=True)
    assert r.store is False


def test_a_repeated_long_input_reports_cached_input_tokens(client, name):
    long = "\n".join(f"import module_{i} as alias_{i}" for i in range(20))
    first = greedy_response(client, name, long, max_output_tokens=2)
    again = greedy_response(client, name, long, max_output_tokens=2)
    assert first.usage.input_tokens == again.usage.input_tokens > 32
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert 16 <= again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens


# ---- streamed responses -------------------------------------------------------------------


def stream_events(client, name, input, max_output_tokens=MAX, extra=None, **kw) -> list:
    with client.responses.create(model=name, input=input, temperature=0, max_output_tokens=max_output_tokens,
                                 stream=True, extra_body={"ignore_eos": True} | (extra or {}), **kw) as stream:
        return list(stream)


def test_a_stream_is_the_typed_events_in_order_numbered_from_zero(client, name):
    whole = greedy_response(client, name, PROMPT)
    events = stream_events(client, name, PROMPT)
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    by_type = {e.type: e for e in events}
    assert by_type["response.output_text.done"].text == text
    assert by_type["response.content_part.done"].part.text == text
    item_id = by_type["response.output_item.added"].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    assert by_type["response.output_item.done"].item.id == item_id
    assert by_type["response.created"].response.status == "in_progress"
    assert by_type["response.created"].response.id == events[-1].response.id
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == whole.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)


def test_a_stream_that_ends_itself_ends_with_response_completed(client, name):
    events = stream_events(client, name, PROMPT, extra={"ignore_eos": False, "min_tokens": 3,
                                                        "logit_bias": {str(EOS): 100}})
    assert events[-1].type == "response.completed"
    assert events[-1].response.status == "completed" and events[-1].response.usage.output_tokens == 4
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_each_raw_event_names_its_type_on_the_event_line(worker, name):
    body = {"model": name, "input": PROMPT, "max_output_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", worker.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    blocks = [b for b in raw.replace("\r\n", "\n").split("\n\n") if b.strip()]
    assert len(blocks) >= 9
    for block in blocks:
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        assert json.loads(lines["data"])["type"] == lines["event"]


# ---- structured output --------------------------------------------------------------------


class Verdict(BaseModel):
    ok: bool
    kind: Literal["bug", "feature", "question"]


def test_parse_gives_the_pydantic_object(client, name):
    r = client.responses.parse(model=name, input=PROMPT, text_format=Verdict, temperature=0, max_output_tokens=60)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Verdict)
    assert Verdict.model_validate_json(r.output_text) == r.output_parsed
    assert r.text.format.type == "json_schema"


def test_sampled_parses_all_follow_the_schema(client, name):
    for seed in range(4):
        r = client.responses.parse(model=name, input=PROMPT, text_format=Verdict, temperature=1.0, max_output_tokens=60,
                                   extra_body={"seed": seed})
        assert r.status == "completed" and isinstance(r.output_parsed, Verdict), r.output_text


def test_stream_with_text_format_gives_the_parsed_object(client, name):
    whole = client.responses.parse(model=name, input=PROMPT, text_format=Verdict, temperature=0, max_output_tokens=60)
    with client.responses.stream(model=name, input=PROMPT, text_format=Verdict, temperature=0,
                                 max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert isinstance(final.output_parsed, Verdict) and final.output_parsed == whole.output_parsed


# ---- function tools -----------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "celsius"],
                          "properties": {"city": {"type": "string", "maxLength": 12}, "celsius": {"type": "boolean"}}}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
NAMED = {"type": "function", "name": "get_weather"}
ASK = "What is the weather in Paris?"


def follows_weather(arguments: str) -> bool:
    value = json.loads(arguments)
    return set(value) == {"city", "celsius"} and isinstance(value["city"], str) and type(value["celsius"]) is bool


def test_a_named_tool_choice_gives_a_function_call_whose_arguments_parse(client, name):
    r = client.responses.create(model=name, input=ASK, tools=[WEATHER], tool_choice=NAMED, temperature=0,
                                max_output_tokens=60)
    assert r.status == "completed"
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id and call.id.startswith("fc_")
    assert follows_weather(call.arguments), call.arguments
    assert r.output_text == ""


def test_a_streamed_function_call_streams_its_arguments(client, name):
    whole = client.responses.create(model=name, input=ASK, tools=[WEATHER], tool_choice=NAMED, temperature=0,
                                    max_output_tokens=60)
    with client.responses.create(model=name, input=ASK, tools=[WEATHER], tool_choice=NAMED, temperature=0,
                                 max_output_tokens=60, stream=True) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == events[-3].arguments == whole.output[0].arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_turn_after_a_function_call_and_its_output_is_answered(client, name):
    first = client.responses.create(model=name, input=ASK, tools=[WEATHER], tool_choice=NAMED, temperature=0,
                                    max_output_tokens=60)
    [call] = first.output
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 degrees"}]
    r = greedy_response(client, name, items, tools=[WEATHER], tool_choice="none")
    assert r.output[0].type == "message" and r.output_text
    chat = greedy_chat(client, name, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 degrees"},
    ], tools=[CHAT_WEATHER], tool_choice="none")
    assert_same_answer(r, chat)
    assert r.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt


# ---- refused ------------------------------------------------------------------------------

REFUSED = {
    "previous_response_id": dict(input=PROMPT, previous_response_id="resp_123"),
    "background": dict(input=PROMPT, background=True),
    "conversation": dict(input=PROMPT, conversation="conv_123"),
    "web_search": dict(input=PROMPT, tools=[{"type": "web_search"}]),
    "input_image": dict(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"}]}]),
    "max_output_tokens": dict(input=PROMPT, max_output_tokens=0),
    "input": dict(input=[]),
    "n": dict(input=PROMPT, extra_body={"n": 2}),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_what_cannot_be_honoured_is_refused_naming_the_field(client, name, field):
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=name, **REFUSED[field])
    assert e.value.status_code == 400
    assert re.search(rf"\b{field}\b", e.value.body["message"]), e.value.body


def test_max_output_tokens_0_names_its_param(client, name):
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=name, input=PROMPT, max_output_tokens=0)
    assert e.value.body["param"] == "max_output_tokens"


# ---- a client that leaves -----------------------------------------------------------------


def test_a_client_that_leaves_mid_stream_leaves_nothing_running(worker, name):
    generated = "preload_generation_tokens_total"
    before = total(worker.metrics(), generated)
    body = {"model": name, "input": PROMPT, "max_output_tokens": 2000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", worker.url + "/v1/responses", json=body) as r:
            assert r.status_code == 200
            lines, deltas = r.iter_lines(), 0
            while deltas < 3:  # (no `break` out of iter_lines: closing it would hang up already)
                deltas += "response.output_text.delta" in next(lines)
            assert total(worker.metrics(), "preload_num_requests_running") == 1
        # leaving the block closes the connection mid-stream

    def settled() -> bool:
        m = worker.metrics()
        return total(m, "preload_num_requests_running") == 0 and total(m, "preload_num_requests_waiting") == 0 \
            and total(m, "preload_kv_blocks_used") == 0

    assert wait_for(settled, timeout=15), worker.metrics()
    assert total(worker.metrics(), generated) - before < 1000  # aborted, not run to the end
    assert worker.post("/v1/responses", {"input": PROMPT, "max_output_tokens": 2}).status_code == 200
