"""--served-model-name (repeated), --max-model-len and --chat-template FILE, as vLLM's
server takes them, through a real `preload serve` worker.

- Every --served-model-name is served: GET /v1/models lists them in the order given, each
  card's `root` the first; /v1/models/{name} answers for each (a name may hold a slash);
  a completion or chat for any of them is answered, and names the first in its `model`
  field (serving.py: "responses name the first", as vLLM's do); any other name, the
  checkpoint directory's included, is a 404 OpenAI error.
- --max-model-len N: the cards and /tokenize say N; prompt + max_tokens up to N is served,
  one token more is a 400 naming the prompt.
- --chat-template FILE: chats are rendered by the file, not by the checkpoint's template,
  exactly as vLLM renders it (transformers' apply_chat_template with that template: the
  oracle here); what /tokenize returns for messages is what chat completions prefill.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import NotFoundError, OpenAI
from transformers import AutoTokenizer
from workers import one_worker

FIRST, SECOND = "alpha-model", "org/beta-model"  # (a slash, as in Hugging Face ids)
MAX_LEN = 64
TEMPLATE = Path(__file__).parent / "hermes_tools.jinja"
USER = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]


def ids(n: int) -> list[int]:
    return [5 + i % 90 for i in range(n)]  # ordinary tokens of any of the test vocabularies


def completion(prompt, max_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | extra


@pytest.fixture(scope="module")
def worker(model, tmp_path_factory):
    with one_worker(model, tmp_path_factory, "served-names", "--served-model-name", FIRST, "--served-model-name",
                    SECOND, "--max-model-len", str(MAX_LEN), "--chat-template", str(TEMPLATE)) as w:
        yield w


@pytest.fixture(scope="module")
def hf(model):
    """The checkpoint's tokenizer in transformers: how vLLM renders a chat template."""
    return AutoTokenizer.from_pretrained(model)


def ok(r) -> dict:
    assert r.status_code == 200, f"{r.status_code}: {r.text}"
    return r.json()


def assert_error(r, status: int, type_: str, param: str | None = None) -> dict:
    assert r.status_code == status, f"{r.status_code}: {r.text}"
    error = r.json()["error"]
    assert error["type"] == type_ and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- --served-model-name -------------------------------------------------------------------


def test_models_lists_every_served_name_in_order_with_the_first_as_root(worker, model):
    body = ok(worker.get("/v1/models"))
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [FIRST, SECOND]
    assert all(m["root"] == FIRST and m["object"] == "model" for m in body["data"])
    assert model.name not in {m["id"] for m in body["data"]}  # the served names replace the checkpoint's


@pytest.mark.parametrize("name", [FIRST, SECOND])
def test_each_served_name_has_its_card(worker, name):
    card = ok(worker.get(f"/v1/models/{name}"))
    assert card["id"] == name and card["root"] == FIRST and card["max_model_len"] == MAX_LEN


@pytest.mark.parametrize("name", [FIRST, SECOND])
def test_a_request_for_any_served_name_is_answered_and_names_the_first(worker, name):
    body = ok(worker.post("/v1/completions", completion(ids(3), 2, model=name)))
    assert body["model"] == FIRST and body["usage"]["completion_tokens"] == 2
    chat = ok(worker.post("/v1/chat/completions",
                          {"model": name, "messages": USER, "max_tokens": 2, "ignore_eos": True}))
    assert chat["model"] == FIRST and chat["usage"]["completion_tokens"] == 2
    assert ok(worker.post("/tokenize", {"model": name, "prompt": "x"}))["count"] >= 1


def test_the_openai_sdk_sees_both_names(worker):
    client = OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [FIRST, SECOND]
    assert client.models.retrieve(SECOND).id == SECOND
    out = client.completions.create(model=SECOND, prompt=ids(3), max_tokens=2, extra_body={"ignore_eos": True})
    assert out.model == FIRST and out.usage.completion_tokens == 2
    with pytest.raises(NotFoundError):
        client.completions.create(model="gpt-4o", prompt=ids(3), max_tokens=2)


@pytest.mark.parametrize("unknown", ["gpt-4o", "alpha", "beta-model", "ALPHA-MODEL", "checkpoint-dir"])
def test_an_unknown_model_is_404(worker, model, unknown):
    unknown = model.name if unknown == "checkpoint-dir" else unknown
    error = assert_error(worker.post("/v1/completions", completion(ids(3), 2, model=unknown)), 404,
                         "not_found_error", "model")
    assert unknown in error["message"]
    assert_error(worker.post("/v1/chat/completions", {"model": unknown, "messages": USER, "max_tokens": 2}), 404,
                 "not_found_error")
    assert_error(worker.get(f"/v1/models/{unknown}"), 404, "not_found_error")


# ---- --max-model-len -----------------------------------------------------------------------


def test_max_model_len_is_what_the_cards_and_tokenize_say(worker):
    assert [m["max_model_len"] for m in ok(worker.get("/v1/models"))["data"]] == [MAX_LEN, MAX_LEN]
    assert ok(worker.post("/tokenize", {"prompt": "x"}))["max_model_len"] == MAX_LEN


def test_a_request_that_fills_max_model_len_exactly_is_served(worker):
    body = ok(worker.post("/v1/completions", completion(ids(MAX_LEN - 3), 3)))
    assert body["usage"] | {"prompt_tokens_details": None} == {
        "prompt_tokens": MAX_LEN - 3, "completion_tokens": 3, "total_tokens": MAX_LEN, "prompt_tokens_details": None}


@pytest.mark.parametrize("prompt_len, max_tokens", [(MAX_LEN + 1, 1), (MAX_LEN, 1), (MAX_LEN - 3, 4), (4 * MAX_LEN, 1)])
def test_a_prompt_longer_than_max_model_len_is_a_400(worker, prompt_len, max_tokens):
    error = assert_error(worker.post("/v1/completions", completion(ids(prompt_len), max_tokens)), 400,
                         "invalid_request_error", "prompt")
    assert str(MAX_LEN) in error["message"]


def test_a_chat_longer_than_max_model_len_is_a_400(worker):
    long = [{"role": "user", "content": "def f(x):\n    return x\n" * 40}]
    assert_error(worker.post("/v1/chat/completions", {"messages": long, "max_tokens": 1}), 400, "invalid_request_error")
    # Without max_tokens, a chat that fits gets the rest of the context (not more).
    body = ok(worker.post("/v1/chat/completions", {"messages": USER, "ignore_eos": True}))
    assert body["usage"]["total_tokens"] == MAX_LEN


# ---- --chat-template FILE ------------------------------------------------------------------


def tokens(worker, text: str) -> list[int]:
    return ok(worker.post("/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"]


def test_chats_are_rendered_by_the_file_not_the_checkpoints_template(worker, hf):
    """A tool's message: the file renders it as a user turn in <tool_response>, the
    checkpoint's template as an assistant turn."""
    messages = USER + [{"role": "assistant", "content": "ok"},
                       {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    by_file = hf.apply_chat_template(messages, chat_template=TEMPLATE.read_text(), tokenize=False,
                                     add_generation_prompt=True)
    by_checkpoint = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>sunny</tool_response>" in by_file and "<tool_response>" not in by_checkpoint  # (the oracle)
    got = ok(worker.post("/tokenize", {"messages": messages}))
    assert got["tokens"] == tokens(worker, by_file)
    assert got["tokens"] != tokens(worker, by_checkpoint)
    assert got["count"] == len(got["tokens"])
    # add_generation_prompt=false: the file's trailing <|assistant|> goes.
    without = hf.apply_chat_template(messages, chat_template=TEMPLATE.read_text(), tokenize=False,
                                     add_generation_prompt=False)
    assert ok(worker.post("/tokenize", {"messages": messages, "add_generation_prompt": False}))["tokens"] == \
        tokens(worker, without)


def test_chat_completions_prefill_what_tokenize_renders(worker):
    want = ok(worker.post("/tokenize", {"messages": USER}))["count"]
    body = ok(worker.post("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "ignore_eos": True}))
    assert body["usage"]["prompt_tokens"] == want


def test_the_files_tool_and_tool_message_parts_are_rendered(worker, hf):
    """What only the file renders (the checkpoint's template knows no tools): the tools'
    list, an assistant's tool call and a tool's response."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    want = hf.apply_chat_template(messages, tools=tools, chat_template=TEMPLATE.read_text(), tokenize=False,
                                  add_generation_prompt=True)
    assert "You may call these functions" in want and "<tool_response>sunny</tool_response>" in want  # (the oracle)
    got = ok(worker.post("/tokenize", {"messages": messages, "tools": tools}))["tokens"]
    assert got == tokens(worker, want)
    text = ok(worker.post("/detokenize", {"tokens": got}))["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text


def test_tools_are_rendered_by_tojson_as_transformers_renders_them(worker, hf):
    """The template's `tojson` is transformers' (what vLLM renders with, and what models are
    trained on): keys in the order given, and quotes, <, >, & and non-ASCII text as they
    are, not jinja2's HTML-safe JSON (sorted keys, \\u0027 \\u003c \\u0026 escapes)."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Today's weather in <city> & around, in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    want = hf.apply_chat_template(USER, tools=tools, chat_template=TEMPLATE.read_text(), tokenize=False,
                                  add_generation_prompt=True)
    # (the oracle)
    assert '{"name": "get_weather", "description": "Today\'s weather in <city> & around, in °C"' in want
    got = ok(worker.post("/tokenize", {"messages": USER, "tools": tools}))["tokens"]
    text = ok(worker.post("/detokenize", {"tokens": got}))["prompt"]
    assert got == tokens(worker, want), f"rendered:\n{text}\nvLLM renders:\n{want}"
