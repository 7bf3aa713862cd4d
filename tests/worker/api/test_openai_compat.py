"""What real clients send (issue 12's table), through the `openai` SDK against a real
worker: chat without max_tokens, content parts, the developer role, null assistant
content and tool messages, n > 1, logit_bias / min_tokens / repetition_penalty, unknown
fields (ignored, logged, named in a header), and the endpoints vLLM serves besides the
OpenAI ones (/tokenize, /detokenize, /version, /ping, /v1/models/{id})."""

from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest
from openai import NotFoundError, OpenAI
from workers import one_worker

USER = [{"role": "user", "content": "t5 t6 t7"}]
STOP = 7  # a token id every vocabulary has


@pytest.fixture(scope="module")
def worker(model, tmp_path_factory):
    with one_worker(model, tmp_path_factory, "compat") as w:
        yield w


@pytest.fixture(scope="module")
def client(worker) -> OpenAI:
    return OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def name(client) -> str:
    return client.models.list().data[0].id


def greedy_chat(client, name, messages, max_tokens=8, **kw):
    return client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=max_tokens,
                                          **{"extra_body": {"ignore_eos": True}} | kw)


def test_chat_without_max_tokens_is_not_cut_at_16(client, name):
    """No max_tokens: the reply may run to the end of the context (vLLM), not 16 tokens.
    Here it stops itself after 31: STOP is banned for the first 30 (min_tokens) and then,
    biased to +100, always the next token."""
    out = client.chat.completions.create(model=name, messages=USER, temperature=0, logit_bias={str(STOP): 100},
                                         extra_body={"min_tokens": 30, "stop_token_ids": [STOP]})
    assert out.usage.completion_tokens == 31
    assert out.choices[0].finish_reason == "stop"


def test_text_parts_are_joined_by_newlines(client, name):
    parts = [{"type": "text", "text": "t5 t6"}, {"type": "text", "text": "t7"}]
    got = greedy_chat(client, name, [{"role": "user", "content": parts}])
    want = greedy_chat(client, name, [{"role": "user", "content": "t5 t6\nt7"}])
    assert got.choices[0].message.content == want.choices[0].message.content


def test_streamed_content_parts_give_the_whole_answer(client, name):
    parts = [{"type": "text", "text": "t5 t6 t7"}]
    whole = greedy_chat(client, name, [{"role": "user", "content": parts}]).choices[0].message.content
    stream = greedy_chat(client, name, [{"role": "user", "content": parts}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole


def test_developer_role_is_the_system_role(client, name):
    got = greedy_chat(client, name, [{"role": "developer", "content": "t8"}] + USER)
    want = greedy_chat(client, name, [{"role": "system", "content": "t8"}] + USER)
    assert got.choices[0].message.content == want.choices[0].message.content


def test_assistant_null_content_tool_calls_and_tool_messages_are_accepted(client, name):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "t9"}]
    out = greedy_chat(client, name, messages)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8


def test_tools_with_tool_choice_none_are_rendered_not_called(client, name):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    out = greedy_chat(client, name, USER, tools=[tool], tool_choice="none")
    assert out.choices[0].message.tool_calls is None


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_each_with_its_index_and_reproducible_with_a_seed(client, name, stream):
    def texts():
        out = client.chat.completions.create(model=name, messages=USER, n=3, seed=11, temperature=1.0, max_tokens=12,
                                             stream=stream, extra_body={"ignore_eos": True})
        if not stream:
            assert [c.index for c in out.choices] == [0, 1, 2]
            assert out.usage.completion_tokens == 36
            return [c.message.content for c in out.choices]
        got, finished = ["", "", ""], set()
        for chunk in out:
            for c in chunk.choices:
                got[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finished.add(c.index)
        assert finished == {0, 1, 2}
        return got

    first = texts()
    assert texts() == first
    assert len(set(first)) > 1  # each choice draws from its own seed


def test_n_on_completions_orders_each_prompts_choices_together(client, name):
    out = client.completions.create(model=name, prompt=["t5 t6", "t7"], n=2, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: a prompt's choices agree
    assert out.usage.completion_tokens == 16


def test_repetition_penalty_is_accepted_and_changes_greedy_output(client, name):
    plain = greedy_chat(client, name, USER, max_tokens=24)
    penalized = greedy_chat(client, name, USER, max_tokens=24, extra_body={"ignore_eos": True, "repetition_penalty": 2.0})
    assert penalized.usage.completion_tokens == 24
    assert penalized.choices[0].message.content != plain.choices[0].message.content


def test_unknown_fields_are_ignored_and_named_in_a_header(client, name, worker):
    extra = {"store": True, "parallel_tool_calls": False, "reasoning_effort": "low", "ignore_eos": True}
    raw = client.chat.completions.with_raw_response.create(model=name, messages=USER, max_tokens=2, extra_body=extra)
    assert raw.http_response.status_code == 200
    assert raw.headers["x-ignored-fields"] == "parallel_tool_calls,reasoning_effort,store"
    assert raw.parse().usage.completion_tokens == 2
    assert "parallel_tool_calls" in worker.log.read_text()  # and logged


def test_tokenize_and_detokenize_round_trip(worker, name):
    r = worker.post("/tokenize", {"model": name, "prompt": "t5 t6 t7"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > 0
    back = worker.post("/detokenize", {"model": name, "tokens": body["tokens"]}).json()
    assert "t5 t6 t7" in back["prompt"]
    chat = worker.post("/tokenize", {"messages": USER}).json()
    assert chat["count"] > body["count"]  # the template's role markers
    assert worker.post("/detokenize", {"tokens": [-1]}).status_code == 400
    assert worker.post("/tokenize", {"messages": USER, "chat_template": "x"}).status_code == 400


def test_version_ping_and_one_model(worker, client, name):
    assert re.fullmatch(r"\S+", worker.get("/version").json()["version"])
    assert worker.get("/ping").status_code == 200 and worker.post("/ping").status_code == 200
    card = client.models.retrieve(name)
    assert card.id == name and card.model_extra["max_model_len"] > 0
    with pytest.raises(NotFoundError):
        client.models.retrieve("gpt-17")


def test_route_labels_are_bounded_whatever_paths_clients_try(worker):
    tried = [f"/{uuid.uuid4().hex}" for _ in range(50)]
    for path in tried:
        assert httpx.get(worker.url + path, timeout=30).status_code == 404
    routes = set(re.findall(r'preload_http_requests_total\{[^}]*route="([^"]*)"', worker.get("/metrics").text))
    assert "unmatched" in routes and not routes & set(tried), routes  # templates only: one series for all 50


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "ok": {"type": "boolean"}}}


def follows_person(text: str) -> bool:
    value = json.loads(text)  # raises if it does not parse
    return (set(value) == {"name", "age", "ok"} and isinstance(value["name"], str) and len(value["name"]) <= 8
            and type(value["age"]) is int and 0 <= value["age"] <= 150 and type(value["ok"]) is bool)


def test_json_schema_outputs_always_parse_and_follow_the_schema(client, name):
    """100 seeded samples at temperature 1: every one parses and validates."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = client.chat.completions.create(model=name, messages=USER, n=100, seed=3, temperature=1.0, max_tokens=120,
                                         response_format=fmt)
    texts = [c.message.content for c in out.choices]
    assert all(c.finish_reason == "stop" for c in out.choices)
    assert all(follows_person(t) for t in texts), [t for t in texts if not follows_person(t)][:3]
    assert len(set(texts)) > 10  # sampled, not one answer


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_on_completions_and_chat(client, name, stream):
    """Any JSON object: every output the grammar finished parses as one (an output cut
    by max_tokens is a prefix of one, as anywhere)."""
    fmt = {"type": "json_object"}
    chat = client.chat.completions.create(model=name, messages=USER, n=30, seed=5, temperature=1.0, max_tokens=60,
                                          response_format=fmt)
    out = client.completions.create(model=name, prompt="t5 t6", n=30, seed=5, temperature=1.0, max_tokens=60,
                                    stream=stream, extra_body={"response_format": fmt})
    if stream:
        texts, finish = [""] * 30, [None] * 30
        for chunk in out:
            for c in chunk.choices:
                texts[c.index] += c.text
                finish[c.index] = c.finish_reason or finish[c.index]
    else:
        texts, finish = [c.text for c in out.choices], [c.finish_reason for c in out.choices]
    done = [m.message.content for m in chat.choices if m.finish_reason == "stop"]
    done += [t for t, f in zip(texts, finish) if f == "stop"]
    assert len(done) >= 10
    assert all(isinstance(json.loads(t), dict) for t in done)
    assert all(t.startswith("{") for t in texts)


def test_choice_and_regex_as_vllm_spells_them(client, name):
    """vLLM's structured_outputs (and its older guided_* fields): a choice of strings, a regex."""
    out = client.chat.completions.create(model=name, messages=USER, n=8, seed=1, temperature=1.0, max_tokens=10,
                                         extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert {c.message.content for c in out.choices} <= {"yes", "no", "maybe"}
    out = client.completions.create(model=name, prompt="t5", n=8, seed=2, temperature=1.0, max_tokens=10,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]"}})
    assert all(re.fullmatch("[0-9]{3}-[a-c]", c.text) for c in out.choices), [c.text for c in out.choices]


@pytest.mark.parametrize("field, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format: no text matches this schema"),
    ({"structured_outputs": {"regex": "(a{1000}){1000}"}},
     "structured output: this regex is too complex to follow: llguidance: lexer error: too many expressions"),
], ids=["self-referring-schema", "regex-over-limits"])
def test_a_grammar_that_cannot_start_is_a_400_naming_why(worker, field, says):
    """Refused at admission: not a 200 with empty text (a schema no text matches), nor a
    500 after seconds of work (a regex over llguidance's limits). Valid ones still run."""
    for route, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "t5"})):
        r = worker.post(route, body | field | {"max_tokens": 8})
        assert r.status_code == 400, r.text
        assert says in r.json()["error"]["message"], r.json()
    ok = worker.post("/v1/completions", {"prompt": "t5", "max_tokens": 8, "structured_outputs": {"regex": "[0-9]{3}"}})
    assert ok.status_code == 200 and re.fullmatch("[0-9]{3}", ok.json()["choices"][0]["text"]), ok.text


DEEP = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
        "required": ["b"]}  # (its first step may begin "a": the pattern is met only once "b" is chosen)


def test_a_grammar_that_cannot_go_on_deep_in_an_output_is_the_requests_fault(worker):
    """A schema whose first step is fine but whose string pattern is past llguidance's
    limits (reached a few tokens in, where admission does not look): the request ends with
    a 400 naming the grammar, not a 500; streamed, the error event says the same."""
    body = {"prompt": "t5", "max_tokens": 32, "temperature": 0, "response_format": {"type": "json_schema",
                                                                   "json_schema": {"name": "x", "schema": DEEP}}}
    r = worker.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    assert "the grammar cannot go on" in r.json()["error"]["message"] and r.json()["error"]["type"] == \
        "invalid_request_error", r.json()
    streamed = worker.post("/v1/completions", body | {"stream": True})
    assert streamed.status_code == 200
    errors = [json.loads(line[5:]) for line in streamed.text.splitlines()
              if line.startswith("data:") and line[5:].strip().startswith('{"error"')]
    assert errors and errors[0]["error"]["code"] == 400 and "the grammar cannot go on" in errors[0]["error"]["message"]
    assert worker.post("/v1/completions", {"prompt": "t5", "max_tokens": 4}).status_code == 200
