"""Tool calling through the `openai` SDK against real workers, as vLLM serves it:

- `tool_choice` a named function: the output is held by the grammar to that tool's
  parameters schema and comes back as the call's arguments (finish_reason "stop"), streamed
  as written: the call's id and name first, then the pieces of its arguments;
- `tool_choice` "required": the output is held to a list of calls to the tools, each
  call's arguments following its tool's schema (finish_reason "tool_calls"), streamed
  once whole; under temperature 0 a stream's joined arguments are the whole reply's;
- `tool_choice` "auto" (a worker started with --enable-auto-tool-choice --tool-call-parser
  hermes and a template that renders tools): calls the model writes as
  <tool_call>{...}</tool_call> come back as tool_calls (finish_reason "tool_calls", no
  content), whole and streamed; a reply without one is plain content;
- refused with a 400: "auto" on a worker started without --enable-auto-tool-choice (the
  message names the flag), a named function that is not one of the tools, "required"
  together with response_format;
- a conversation carrying the assistant's calls and the `tool` messages answering them is
  rendered with the tool result in the prompt, and answered.

The tiny model writes Python and would never call a tool by itself: the schemas are
bounded (enums, booleans, small integers) so that the grammar finishes within max_tokens,
and under "auto" the call's text is forced with vLLM's `structured_outputs` regex.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from daemons import running_daemon
from openai import BadRequestError, OpenAI
from workers import running_workers

TEMPLATE = Path(__file__).resolve().parent / "hermes_tools.jinja"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]

WEATHER = {
    "type": "object", "additionalProperties": False, "required": ["city", "unit", "detailed"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "detailed": {"type": "boolean"}},
}
ALARM = {
    "type": "object", "additionalProperties": False, "required": ["hour", "loud"],
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
}
TOOLS = [
    {"type": "function",
     "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}},
    {"type": "function",
     "function": {"name": "set_alarm", "description": "An alarm at an hour.", "parameters": ALARM}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
FORCED_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def workers(model, tmp_path_factory):
    """Two workers on one daemon: `auto` serves tool_choice "auto" (hermes), `plain` does not."""
    auto = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(TEMPLATE))
    with running_daemon(tmp_path_factory.mktemp("tools") / "state", model, "--dtype", "float32") as d, \
            running_workers(d.state_dir, tmp_path_factory.mktemp("logs"), auto, ()) as ws:
        yield dict(zip(("auto", "plain"), ws))


def sdk(worker) -> OpenAI:
    return OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(workers) -> OpenAI:
    return sdk(workers["auto"])


@pytest.fixture(scope="module")
def plain(workers) -> OpenAI:
    return sdk(workers["plain"])


@pytest.fixture(scope="module")
def name(client) -> str:
    return client.models.list().data[0].id


def follows(schema: dict, value) -> bool:
    """Whether `value` follows one of the schemas above (objects of enums, booleans, bounded integers)."""
    if not isinstance(value, dict) or set(value) != set(schema["required"]):
        return False
    for key, spec in schema["properties"].items():
        v = value[key]
        if "enum" in spec and v not in spec["enum"]:
            return False
        if spec["type"] == "boolean" and type(v) is not bool:
            return False
        if spec["type"] == "integer" and not (type(v) is int and spec["minimum"] <= v <= spec["maximum"]):
            return False
    return True


def chat(client, name, max_tokens=60, **kw):
    return client.chat.completions.create(model=name, messages=USER, temperature=0, max_tokens=max_tokens,
                                          tools=TOOLS, **kw)


def streamed_calls(stream) -> tuple[list[dict], str | None, str, list]:
    """A stream's tool-call deltas accumulated by index as the SDK's users do:
    ([{id, name, arguments}], finish_reason, content, the tool-call deltas in order)."""
    calls: dict[int, dict] = {}
    finish, content, deltas = None, "", []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                deltas.append(d)
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    call["id"] = d.id
                if d.function and d.function.name:
                    call["name"] = d.function.name
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
            finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content, deltas


# --- a named function ---------------------------------------------------------------


def test_a_named_function_returns_arguments_that_follow_its_schema(client, name):
    out = chat(client, name, tool_choice=NAMED)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI's forced calls end
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert follows(WEATHER, json.loads(call.function.arguments)), call.function.arguments


def test_a_named_function_held_to_its_schema_whatever_the_sample(client, name):
    """Sampled at temperature 1, every choice's arguments parse and follow the schema."""
    alarm = {"type": "function", "function": {"name": "set_alarm"}}
    out = client.chat.completions.create(model=name, messages=USER, tools=TOOLS, n=12, seed=4, temperature=1.0,
                                         max_tokens=60, tool_choice=alarm)
    args = [c.message.tool_calls[0].function.arguments for c in out.choices]
    assert all(c.finish_reason == "stop" and c.message.tool_calls[0].function.name == "set_alarm" for c in out.choices)
    assert all(follows(ALARM, json.loads(a)) for a in args), args
    assert len(set(args)) > 1  # sampled, not one answer


def test_a_named_function_streams_its_id_and_name_first_then_the_arguments(client, name):
    whole = chat(client, name, tool_choice=NAMED).choices[0].message.tool_calls[0]
    calls, finish, content, deltas = streamed_calls(chat(client, name, tool_choice=NAMED, stream=True))
    assert finish == "stop" and content == ""
    (call,) = calls
    assert call["name"] == "get_weather" and call["id"].startswith("chatcmpl-tool-")
    assert call["arguments"] == whole.function.arguments  # greedy: the same call
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.function.name == "get_weather" and not first.function.arguments
    assert len(rest) > 1, "the arguments come in pieces as they are written"
    assert all(d.index == 0 and d.id is None and not d.function.name and d.function.arguments for d in rest)


def test_a_named_functions_arguments_hold_only_its_properties(client, name):
    """A schema that does not say additionalProperties: the arguments still carry only the
    properties it names, as vLLM's default structured-output backend (xgrammar, strict
    mode) holds them; not keys the model made up."""
    open_tools = [{"type": "function", "function": {"name": n, "parameters": {k: v for k, v in s.items()
                                                                               if k != "additionalProperties"}}}
                  for n, s in SCHEMAS.items()]
    for n, schema in SCHEMAS.items():
        out = client.chat.completions.create(model=name, messages=USER, tools=open_tools, temperature=0, max_tokens=60,
                                             tool_choice={"type": "function", "function": {"name": n}})
        arguments = out.choices[0].message.tool_calls[0].function.arguments
        assert follows(schema, json.loads(arguments)), arguments


# --- "required" ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def closing(workers, name) -> dict[str, float]:
    """A logit_bias toward } and ]: the tiny model would go on adding calls to the list
    for ever (the grammar lets it; a real model stops); biased, it closes after one."""
    r = workers["auto"].post("/tokenize", {"model": name, "prompt": "}]", "add_special_tokens": False})
    ids = r.json()["tokens"]
    assert len(ids) == 2
    return {str(i): 10.0 for i in ids}


def test_required_returns_calls_to_the_tools_that_follow_their_schemas(client, name, closing):
    out = chat(client, name, max_tokens=120, tool_choice="required", logit_bias=closing)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name in SCHEMAS
        assert follows(SCHEMAS[call.function.name], json.loads(call.function.arguments)), call.function.arguments


def test_required_held_to_the_tools_whatever_the_sample(client, name, closing):
    out = client.chat.completions.create(model=name, messages=USER, tools=TOOLS, n=12, seed=4, temperature=1.0,
                                         max_tokens=120, tool_choice="required", logit_bias=closing)
    calls = [call for c in out.choices for call in c.message.tool_calls]
    assert all(c.finish_reason == "tool_calls" for c in out.choices)
    assert all(follows(SCHEMAS[c.function.name], json.loads(c.function.arguments)) for c in calls)
    assert {c.function.name for c in calls} == set(SCHEMAS)  # either tool may be called


def test_required_streamed_gives_the_same_calls(client, name, closing):
    whole = chat(client, name, max_tokens=120, tool_choice="required", logit_bias=closing).choices[0].message.tool_calls
    calls, finish, content, _ = streamed_calls(chat(client, name, max_tokens=120, tool_choice="required",
                                                    logit_bias=closing, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"] for c in calls)


# --- "auto", with the hermes parser ---------------------------------------------------


def forced_call(client, name, **kw):
    return chat(client, name, tool_choice="auto", extra_body={"structured_outputs": {"regex": FORCED_CALL}}, **kw)


def test_auto_finds_the_call_the_model_wrote(client, name):
    out = forced_call(client, name)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None  # the call's text is not content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})


def test_auto_streamed_gives_the_call_and_no_content(client, name):
    whole = forced_call(client, name).choices[0].message.tool_calls[0]
    calls, finish, content, _ = streamed_calls(forced_call(client, name, stream=True))
    assert finish == "tool_calls"
    assert content == ""  # nothing of <tool_call>... leaks out as content
    (call,) = calls
    assert call["id"] and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == json.loads(whole.function.arguments)


def test_auto_without_a_call_is_plain_content(client, name):
    out = chat(client, name, max_tokens=8, tool_choice="auto")
    choice = out.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content and choice.finish_reason == "length"
    stream = chat(client, name, max_tokens=8, tool_choice="auto", stream=True)
    calls, finish, content, _ = streamed_calls(stream)
    assert calls == [] and finish == "length" and content == choice.message.content


def test_tools_without_tool_choice_mean_auto(client, name):
    """The SDK sends no tool_choice with tools: that is "auto" (the call is found)."""
    out = chat(client, name, extra_body={"structured_outputs": {"regex": FORCED_CALL}})
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.tool_calls[0].function.name == "get_weather"


# --- refused --------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_without_the_flag_is_a_400_naming_it(plain, name, choice):
    kw = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(BadRequestError) as e:
        chat(plain, name, max_tokens=4, **kw)
    assert e.value.status_code == 400
    assert "--enable-auto-tool-choice" in e.value.message


def test_an_unknown_named_function_is_a_400(client, name):
    with pytest.raises(BadRequestError) as e:
        chat(client, name, max_tokens=4, tool_choice={"type": "function", "function": {"name": "launch_rocket"}})
    assert e.value.status_code == 400 and "launch_rocket" in e.value.message


def test_required_with_a_response_format_is_a_400(client, name):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    with pytest.raises(BadRequestError) as e:
        chat(client, name, max_tokens=4, tool_choice="required", response_format=fmt)
    assert e.value.status_code == 400
    assert "response_format" in e.value.message


# --- a conversation with tool results -------------------------------------------------

RESULT = '{"temperature": 21, "sky": "clear"}'
CALLED = [{"id": "call_7", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "detailed": false}'}}]
TURNS = USER + [{"role": "assistant", "content": None, "tool_calls": CALLED},
                {"role": "tool", "tool_call_id": "call_7", "content": RESULT}]


def test_a_tool_result_is_rendered_into_the_prompt_and_answered(client, name, workers):
    w = workers["auto"]
    tokenized = w.post("/tokenize", {"model": name, "messages": TURNS, "tools": TOOLS})
    assert tokenized.status_code == 200, tokenized.text
    prompt = w.post("/detokenize", {"model": name, "tokens": tokenized.json()["tokens"]}).json()["prompt"]
    assert f"<tool_response>{RESULT}</tool_response>" in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in prompt  # the assistant's call

    out = client.chat.completions.create(model=name, messages=TURNS, tools=TOOLS, tool_choice="auto", temperature=0,
                                         max_tokens=8)
    assert out.choices[0].message.content and out.choices[0].finish_reason == "length"
    assert out.choices[0].message.tool_calls is None
    assert out.usage.prompt_tokens == tokenized.json()["count"]
    without = client.chat.completions.create(model=name, messages=TURNS[:2], tools=TOOLS, tool_choice="auto",
                                             temperature=0, max_tokens=1)
    assert out.usage.prompt_tokens > without.usage.prompt_tokens


def test_a_tool_result_then_a_forced_named_call(client, name):
    """The next turn may call again: held to the schema as on the first."""
    out = client.chat.completions.create(model=name, messages=TURNS, tools=TOOLS, tool_choice=NAMED, temperature=0,
                                         max_tokens=60)
    (call,) = out.choices[0].message.tool_calls
    assert follows(WEATHER, json.loads(call.function.arguments)) and out.choices[0].finish_reason == "stop"
