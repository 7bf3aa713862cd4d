"""Bad input through a real worker: every malformed, out-of-range or refused request
gets an OpenAI-style `{"error": {"message", "type", "code"}}` body with the right 4xx
status, and the very next good request is served. One daemon and one worker (started
with --max-request-bytes 64KiB, without --trust-request-chat-template) serve the module.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from daemons import total
from openai import OpenAI
from workers import one_worker

MAX_REQUEST_BYTES = 64 << 10
VALIDATION = {400, 422}  # a body that is not valid JSON, or not the right shape: either is honest


@pytest.fixture(scope="module")
def worker(model, tmp_path_factory):
    with one_worker(model, tmp_path_factory, "errors", "--max-request-bytes", "64KiB") as w:
        yield w


@pytest.fixture(scope="module")
def ctx(worker) -> int:
    return worker.get("/v1/models").json()["data"][0]["max_model_len"]


def assert_openai_error(r: httpx.Response, statuses: set[int]) -> dict:
    assert r.status_code in statuses, f"{r.status_code}: {r.text[:300]}"
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err
    return err


def assert_still_serving(worker) -> None:
    r = worker.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


USER = [{"role": "user", "content": "t5 t6"}]


def cases(vocab: int, ctx: int) -> dict[str, tuple[str, object, set[int]]]:
    """name -> (route, JSON body or raw bytes, acceptable statuses)."""
    C, CH, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"
    return {
        # not JSON, or not a JSON object
        "invalid-json": (C, b'{"prompt": "t5",', VALIDATION),
        "json-array": (C, b"[1, 2]", VALIDATION),
        "empty-body": (C, b"", VALIDATION),
        "chat-invalid-json": (CH, b'{"messages": [', VALIDATION),
        # wrong types
        "prompt-number": (C, {"prompt": 5}, VALIDATION),
        "prompt-object": (C, {"prompt": {"text": "t5"}}, VALIDATION),
        "max-tokens-string": (C, {"prompt": "t5", "max_tokens": "many"}, VALIDATION),
        "max-tokens-fraction": (C, {"prompt": "t5", "max_tokens": 5.5}, VALIDATION),
        "max-tokens-bool": (C, {"prompt": "t5", "max_tokens": True}, VALIDATION),
        "prompt-ids-bools": (C, {"prompt": [True, False]}, VALIDATION),
        "temperature-string": (C, {"prompt": "t5", "temperature": "hot"}, VALIDATION),
        "stop-number": (C, {"prompt": "t5", "stop": 5}, VALIDATION),
        "stream-not-bool": (C, {"prompt": "t5", "stream": "maybe"}, VALIDATION),
        "seed-string": (C, {"prompt": "t5", "seed": "abc"}, VALIDATION),
        "messages-string": (CH, {"messages": "hi"}, VALIDATION),
        "message-without-content": (CH, {"messages": [{"role": "user"}]}, VALIDATION),
        "message-bad-role": (CH, {"messages": [{"role": "robot", "content": "t5"}]}, VALIDATION),
        # unknown model
        "unknown-model": (C, {"prompt": "t5", "model": "gpt-17"}, {404}),
        "chat-unknown-model": (CH, {"messages": USER, "model": "gpt-17"}, {404}),
        # beyond the context length
        "prompt-plus-max-tokens-too-long": (C, {"prompt": [5] * (ctx - 4), "max_tokens": 5}, {400}),
        "max-tokens-beyond-context": (C, {"prompt": [5, 6], "max_tokens": ctx}, {400}),
        "prompt-longer-than-context": (C, {"prompt": [5] * (ctx + 1), "max_tokens": 1}, {400}),
        "too-long-streamed": (C, {"prompt": [5] * ctx, "max_tokens": 1, "stream": True}, {400}),
        "one-of-a-list-too-long": (C, {"prompt": [[5, 6], [5] * ctx], "max_tokens": 1}, {400}),
        "chat-too-long": (CH, {"messages": [{"role": "user", "content": "t5 " * ctx}]}, {400}),
        # negative and huge max_tokens
        "max-tokens-negative": (C, {"prompt": "t5", "max_tokens": -1}, {400}),
        "max-tokens-huge": (C, {"prompt": "t5", "max_tokens": 10**12}, {400}),
        "max-tokens-zero-without-echo": (C, {"prompt": "t5", "max_tokens": 0}, {400}),
        "chat-max-tokens-negative": (CH, {"messages": USER, "max_tokens": -5}, {400}),
        "chat-max-tokens-huge": (CH, {"messages": USER, "max_tokens": 2**40}, {400}),
        "chat-max-tokens-zero": (CH, {"messages": USER, "max_tokens": 0}, {400}),
        "chat-max-completion-tokens-zero": (CH, {"messages": USER, "max_completion_tokens": 0}, {400}),
        # sampling parameters out of range
        "temperature-too-high": (C, {"prompt": "t5", "temperature": 2.5}, {400}),
        "temperature-negative": (C, {"prompt": "t5", "temperature": -0.1}, {400}),
        "chat-temperature-too-high": (CH, {"messages": USER, "temperature": 9}, {400}),
        "top-p-zero": (C, {"prompt": "t5", "top_p": 0}, {400}),
        "top-k-negative": (C, {"prompt": "t5", "top_k": -1}, {400}),
        "logprobs-too-many": (C, {"prompt": "t5", "logprobs": 21}, {400}),
        "presence-penalty-too-high": (C, {"prompt": "t5", "presence_penalty": 3}, {400}),
        "n-zero": (C, {"prompt": "t5", "n": 0}, VALIDATION),
        "n-too-many": (C, {"prompt": "t5", "n": 129}, VALIDATION),
        "best-of-other-than-n": (C, {"prompt": "t5", "best_of": 3}, VALIDATION),
        "repetition-penalty-zero": (C, {"prompt": "t5", "repetition_penalty": 0}, {400}),
        "min-tokens-above-max-tokens": (C, {"prompt": "t5", "max_tokens": 2, "min_tokens": 3}, {400}),
        "logit-bias-key-not-an-id": (C, {"prompt": "t5", "logit_bias": {"hello": 5}}, VALIDATION),
        "logit-bias-too-large": (C, {"prompt": "t5", "logit_bias": {"5": 101}}, {400}),
        "logit-bias-outside-vocab": (C, {"prompt": "t5", "logit_bias": {str(vocab): 1}}, {400}),
        "seed-out-of-range": (C, {"prompt": "t5", "seed": 2**64}, {400}),
        "seed-very-negative": (C, {"prompt": "t5", "seed": -(2**63) - 1}, {400}),
        # empty prompts
        "empty-text": (C, {"prompt": ""}, {400}),
        "empty-ids": (C, {"prompt": []}, {400}),
        "empty-in-list-of-ids": (C, {"prompt": [[5], []]}, {400}),
        "empty-in-list-of-texts": (C, {"prompt": ["t5", ""]}, {400}),
        "no-messages": (CH, {"messages": []}, {400}),
        "responses-empty-input": (R, {"input": []}, {400}),
        "responses-previous-response-id": (R, {"input": "t5", "previous_response_id": "resp_1"}, {400}),
        "responses-max-output-tokens-zero": (R, {"input": "t5", "max_output_tokens": 0}, {400}),
        "responses-image-part": (R, {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, {400}),
        "responses-unknown-item": (R, {"input": [{"type": "computer_call_output"}]}, {400}),
        "responses-built-in-tool": (R, {"input": "t5", "tools": [{"type": "file_search"}]}, {400}),
        # token ids outside the vocabulary
        "id-equal-to-vocab": (C, {"prompt": [5, vocab]}, {400}),
        "id-negative": (C, {"prompt": [5, -1]}, {400}),
        "id-huge": (C, {"prompt": [5, 2**70]}, {400}),
        "id-outside-in-list": (C, {"prompt": [[5], [vocab + 10]]}, {400}),
        # unknown fields are ignored, except those that would change server-side processing
        "processor-kwargs": (C, {"prompt": "t5", "mm_processor_kwargs": {}}, {400}),
        "guided-grammar": (CH, {"messages": USER, "guided_grammar": "root ::= x"}, {400}),
        "two-structured-outputs": (CH, {"messages": USER, "guided_choice": ["a"], "guided_regex": "b"}, VALIDATION),
        "bad-regex": (C, {"prompt": "t5", "structured_outputs": {"regex": "("}}, VALIDATION),
        "legacy-functions": (CH, {"messages": USER, "functions": []}, {400}),
        "completion-chat-template": (C, {"prompt": "t5", "chat_template": "x"}, {400}),
        "stream-options-unknown-key": (C, {"prompt": "t5", "stream_options": {"bogus": True}}, {400}),
        # what the model cannot do
        "image-part": (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                       VALIDATION),
        "text-part-without-text": (CH, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, VALIDATION),
        # auto needs --enable-auto-tool-choice and a parser, as in vLLM
        "tools-auto": (CH, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, VALIDATION),
        "tool-choice-unknown-name": (CH, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, {400}),
        "tool-choice-without-tools": (CH, {"messages": USER, "tool_choice": "required"}, {400}),
        "tool-choice-required-and-response-format": (
            CH, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                 "response_format": {"type": "json_object"}}, {400}),
        "tool-not-a-function": (CH, {"messages": USER, "tools": [{"type": "web_search"}], "tool_choice": "required"},
                                {400}),
        "suffix": (C, {"prompt": "t5", "suffix": "t6"}, VALIDATION),
        "min-p-above-one": (C, {"prompt": "t5", "min_p": 1.5}, {400}),
        "min-p-negative": (C, {"prompt": "t5", "min_p": -0.1}, {400}),
        "prompt-logprobs-too-many": (C, {"prompt": "t5", "prompt_logprobs": 21}, {400}),
        "prompt-logprobs-negative": (CH, {"messages": USER, "prompt_logprobs": -1}, {400}),
        "response-format-unknown-type": (CH, {"messages": USER, "response_format": {"type": "yaml"}}, VALIDATION),
        "response-format-not-a-schema": (C, {"prompt": "t5", "response_format": {"type": "json_schema",
                                                                                  "json_schema": {"schema": {"type": 5}}}},
                                         VALIDATION),
        "response-format-without-schema": (CH, {"messages": USER, "response_format": {"type": "json_schema"}}, VALIDATION),
        # request-supplied templates change server-side processing: refused without the trust flag
        "chat-template": (CH, {"messages": USER, "chat_template": "{{ messages[0]['content'] }}"}, {400}),
        "chat-template-kwargs": (CH, {"messages": USER, "chat_template_kwargs": {"enable_thinking": True}}, {400}),
        "chat-template-streamed": (CH, {"messages": USER, "chat_template": "x", "stream": True}, {400}),
    }


CASE_NAMES = list(cases(100, 100))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_request_gets_openai_error_and_worker_keeps_serving(worker, vocab, ctx, name):
    route, body, statuses = cases(vocab, ctx)[name]
    if isinstance(body, bytes):
        r = httpx.post(worker.url + route, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = worker.post(route, body)
    err = assert_openai_error(r, statuses)
    if name.startswith("chat-template"):
        assert "--trust-request-chat-template" in err["message"]
    assert_still_serving(worker)


def test_oversized_body_is_413(worker):
    big = json.dumps({"prompt": "t5 " * (MAX_REQUEST_BYTES // 3 + 100), "max_tokens": 1}).encode()
    assert len(big) > MAX_REQUEST_BYTES
    r = httpx.post(worker.url + "/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(r, {413})
    assert_still_serving(worker)
    # Just under the limit is read and judged on its merits (too long a prompt: 400, not 413).
    under = json.dumps({"prompt": "t5 " * ((MAX_REQUEST_BYTES - 100) // 3), "max_tokens": 1}).encode()
    assert len(under) <= MAX_REQUEST_BYTES
    r = httpx.post(worker.url + "/v1/completions", content=under, headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(r, {400})


def test_oversized_chunked_body_without_content_length_is_413(worker):
    big = json.dumps({"prompt": "t5 " * (4 * MAX_REQUEST_BYTES // 3), "max_tokens": 1}).encode()

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    r = httpx.post(worker.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    assert_openai_error(r, {413})
    assert_still_serving(worker)


def test_unknown_route_and_wrong_method_get_openai_errors(worker):
    assert_openai_error(worker.post("/v1/nothing-here", {}), {404})
    assert_openai_error(worker.get("/v1/completions"), {405})
    assert_still_serving(worker)


def test_openai_client_raises_the_matching_errors(worker, model, ctx):
    client = OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="t5", max_tokens=2)
    assert "gpt-17" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model.name, prompt=[5] * ctx, max_tokens=2)
    assert "context" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model.name, messages=USER, temperature=5)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model.name, messages=USER, extra_body={"chat_template": "x"})
    out = client.completions.create(model=model.name, prompt=[5, 6], max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_after_all_the_bad_input_nothing_is_left_running(worker):
    m = worker.metrics()
    assert total(m, "preload_kv_blocks_used") == 0 and total(m, "preload_num_requests_running") == 0 and total(m, "preload_num_requests_waiting") == 0
    assert worker.proc.poll() is None
    assert worker.get("/health").status_code == 200
