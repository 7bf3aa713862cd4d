"""LangChain's `ChatOpenAI` (langchain-openai) against a real worker, as it is pointed at
vLLM (`base_url`, any api_key, the served model's name):

- `invoke` answers, and `stream`'s chunks join to the same answer (greedy);
- `bind_tools(..., tool_choice=<a tool>)`: the output is held to the tool's schema, and
  comes back as `AIMessage.tool_calls` with the arguments parsed;
- a conversation that carries the call and a `ToolMessage` with its result is rendered
  with the result and answered (the worker serves "auto" tool choice, which LangChain
  sends whenever tools are bound without a choice);
- `with_structured_output(Model, method="function_calling")` and
  `method="json_schema"` return instances of the model.

The tiny model writes Python; the pydantic models here are of enums and booleans, so
that the grammar ends them within max_tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from workers import one_worker

TEMPLATE = Path(__file__).resolve().parent / "hermes_tools.jinja"
QUESTION = "What is the weather in Paris?"
RESULT = '{"temperature": 21, "sky": "clear"}'


class GetWeather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome", "Oslo"] = Field(description="The city")
    unit: Literal["celsius", "fahrenheit"]
    detailed: bool


class Verdict(BaseModel):
    """Whether the code is fine."""

    fine: bool
    severity: Literal["low", "medium", "high"]


@pytest.fixture(scope="module")
def worker(model, tmp_path_factory):
    auto = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(TEMPLATE))
    with one_worker(model, tmp_path_factory, "langchain", *auto) as w:
        yield w


@pytest.fixture(scope="module")
def llm(worker) -> ChatOpenAI:
    name = worker.get("/v1/models").json()["data"][0]["id"]
    return ChatOpenAI(model=name, api_key="x", base_url=worker.url + "/v1", max_retries=0, timeout=120,
                      temperature=0, max_tokens=60)


def test_invoke_answers(llm):
    out = llm.bind(max_tokens=10).invoke(QUESTION)
    assert isinstance(out, AIMessage) and out.content
    assert out.usage_metadata["output_tokens"] <= 10 and out.usage_metadata["input_tokens"] > 0
    assert out.response_metadata["finish_reason"] in ("stop", "length")


def test_stream_chunks_join_to_the_invoke_answer(llm):
    short = llm.bind(max_tokens=12)
    whole = short.invoke(QUESTION).content
    chunks = list(short.stream(QUESTION))
    assert len([c for c in chunks if c.content]) > 1  # streamed, not one piece
    assert "".join(c.content for c in chunks) == whole


def test_bound_tool_forced_by_name_comes_back_as_tool_calls_with_parsed_args(llm):
    out = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke(QUESTION)
    (call,) = out.tool_calls
    assert call["name"] == "GetWeather" and call["id"]
    assert isinstance(call["args"], dict)
    GetWeather.model_validate(call["args"])  # the enums and the boolean, as the schema says
    assert set(call["args"]) == set(GetWeather.model_fields)  # and nothing else
    assert not out.invalid_tool_calls


def test_a_tool_message_with_the_result_is_rendered_and_answered(llm, worker):
    tools = llm.bind_tools([GetWeather])  # no tool_choice: LangChain leaves it to the server ("auto")
    called = AIMessage(content="", tool_calls=[{"name": "GetWeather", "id": "call_1", "type": "tool_call",
                                               "args": {"city": "Paris", "unit": "celsius", "detailed": False}}])
    turns = [HumanMessage(QUESTION), called, ToolMessage(RESULT, tool_call_id="call_1")]
    out = tools.bind(max_tokens=8).invoke(turns)
    assert isinstance(out, AIMessage) and out.content and not out.tool_calls
    before = tools.bind(max_tokens=1).invoke(turns[:2])
    result_tokens = worker.post("/tokenize", {"prompt": RESULT, "add_special_tokens": False}).json()["count"]
    assert out.usage_metadata["input_tokens"] - before.usage_metadata["input_tokens"] >= result_tokens


def test_a_forced_call_after_a_tool_result(llm):
    """The next turn may call again, held to the schema as on the first."""
    called = AIMessage(content="", tool_calls=[{"name": "GetWeather", "id": "call_1", "type": "tool_call",
                                               "args": {"city": "Paris", "unit": "celsius", "detailed": False}}])
    turns = [HumanMessage(QUESTION), called, ToolMessage(RESULT, tool_call_id="call_1"), HumanMessage("And Rome?")]
    out = llm.bind_tools([GetWeather], tool_choice="GetWeather").bind(max_tokens=120).invoke(turns)
    assert not out.invalid_tool_calls
    (call,) = out.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output_returns_the_model(llm, method):
    out = llm.with_structured_output(Verdict, method=method).invoke("Is `print(1)` fine?")
    assert isinstance(out, Verdict)
    assert type(out.fine) is bool and out.severity in ("low", "medium", "high")


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output_include_raw_has_the_message(llm, method):
    out = llm.with_structured_output(GetWeather, method=method, include_raw=True).invoke(QUESTION)
    assert out["parsing_error"] is None
    assert isinstance(out["parsed"], GetWeather)
    assert isinstance(out["raw"], AIMessage)
