"""The issue's "Done when", as a vLLM user would try it, in one real-process test:

    preload start bundled/tiny-v3 --device cpu --api-key K --allowed-origins http://example.com --vllm-metrics

(plus free ports, a state dir of its own and float32). Then, against the URL it prints:
/v1 answers 401 without the key; a browser's preflight gets the origin back; tool_choice
"required" and a named function return tool calls whose arguments parse as JSON and follow
the tool's schema (an enum field); echo + logprobs 1 + max_tokens 0 scores the prompt
(top_logprobs: None for the first token, then dicts); /v1/responses answers with
output_text; and /metrics, open without the key, carries vllm:num_requests_waiting and
vllm:generation_tokens_total with the values of preload_num_requests_waiting and
preload_generation_tokens_total (and every other vLLM name with its preload_ values).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from daemons import daemon_processes, free_port, metrics, preload, stop_everything, total
from vllm_names import assert_vllm_names_match
from workers import bundled_model_ready

from preload import BUNDLED_MODEL

KEY = "sk-smoke-3e7d"
ORIGIN = "http://example.com"
START_TIMEOUT = 180
UNITS = ["celsius", "fahrenheit"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["unit", "days"],
                   "properties": {"unit": {"type": "string", "enum": UNITS},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
PARAMETERS_THEN = re.compile(r'"parameters":\{[^{}]*\}(.?)')  # (the tools' arguments hold no nested object)
USER = [{"role": "user", "content": "What will the weather be in Oslo?"}]


def follows_schema(call) -> dict:
    """The call's arguments, parsed, after checking them against its tool's schema."""
    args = json.loads(call.function.arguments)  # raises unless JSON
    if call.function.name == "get_weather":
        assert set(args) == {"unit", "days"} and args["unit"] in UNITS, args
        assert type(args["days"]) is int and 1 <= args["days"] <= 7, args
    else:
        assert call.function.name == "get_time", call.function.name
        assert args in ({"zone": "UTC"}, {"zone": "CET"}), args
    return args


@pytest.mark.skipif(not bundled_model_ready(), reason="the bundled model has not been trained")
def test_a_vllm_user_gets_what_vllm_gives(tmp_path):
    model = Path(BUNDLED_MODEL)
    state_dir, port = tmp_path / "state", free_port()
    try:
        r = preload("start", model, "--device", "cpu", "--dtype", "float32", "--api-key", KEY, "--allowed-origins",
                    ORIGIN, "--vllm-metrics", "--port", port, "--health-port", free_port(), "--state-dir", state_dir,
                    timeout=START_TIMEOUT)
        assert r.returncode == 0, r.stdout + r.stderr
        url = f"http://127.0.0.1:{port}/v1"
        assert f"serving {url} (1 worker)" in r.stdout, r.stdout
        assert KEY not in r.stdout + r.stderr  # the key is never echoed
        with httpx.Client(timeout=120) as http:
            auth = {"Authorization": f"Bearer {KEY}"}

            # The key: 401 (an OpenAI error body) without it, on every /v1 route.
            for response in (http.get(url + "/models"),
                             http.post(url + "/completions", json={"prompt": "x", "max_tokens": 1}),
                             http.post(url + "/chat/completions", json={"messages": USER, "max_tokens": 1}),
                             http.get(url + "/models", headers={"Authorization": "Bearer sk-wrong"})):
                assert response.status_code == 401, response.text
                assert response.json()["error"]["type"] == "authentication_error"
            assert http.get(url + "/models", headers=auth).status_code == 200

            # CORS: a browser's preflight is answered with the origin, before any key.
            pre = http.options(url + "/chat/completions", headers={
                "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            assert pre.status_code == 200, pre.text
            assert pre.headers["access-control-allow-origin"] == ORIGIN
            assert "authorization" in pre.headers["access-control-allow-headers"].lower()

            client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
            name = client.models.list().data[0].id
            assert name == model.name

            # Scoring a prompt, as lm-eval does: echo + logprobs 1 + max_tokens 0.
            prompt = "import os\nimport sys\n"
            scored = client.completions.create(model=name, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
            [choice] = scored.choices
            lp = choice.logprobs
            assert choice.text == prompt and scored.usage.completion_tokens == 0
            n = scored.usage.prompt_tokens
            assert n > 2 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
            assert lp.top_logprobs[0] is None and lp.token_logprobs[0] is None
            for top, logprob in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]):
                assert isinstance(top, dict) and 1 <= len(top) <= 2, top  # the top one, and the prompt's own token
                assert all(v <= 0 for v in top.values()) and logprob <= 0 and max(top.values()) >= logprob

            # The Responses API.
            raw = http.post(url + "/responses", headers=auth, json={"model": name, "input": "def add(a, b):",
                                                                    "max_output_tokens": 8, "temperature": 0})
            assert raw.status_code == 200, raw.text
            parts = [p for item in raw.json()["output"] if item["type"] == "message" for p in item["content"]]
            assert parts and all(p["type"] == "output_text" and isinstance(p["text"], str) for p in parts), raw.json()
            assert client.responses.create(model=name, input="def add(a, b):", max_output_tokens=8).output_text

            # Tools: a named function holds the output to its schema; the arguments are JSON that follows it.
            named = client.chat.completions.create(
                model=name, messages=USER, tools=[WEATHER, CLOCK], temperature=0, max_tokens=64,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            [call] = named.choices[0].message.tool_calls
            assert call.type == "function" and call.function.name == "get_weather" and call.id
            follows_schema(call)

            # /metrics: open without the key, vLLM's names with our values.
            scraped = http.get(url.removesuffix("/v1") + "/metrics", headers={"connection": "close"})
            assert scraped.status_code == 200
            m = metrics(scraped.text)
            for vllm, ours in (("vllm:num_requests_waiting", "preload_num_requests_waiting"),
                               ("vllm:generation_tokens_total", "preload_generation_tokens_total")):
                assert total(m, vllm) == total(m, ours), vllm
            assert total(m, "vllm:generation_tokens_total") > 0 and total(m, "vllm:num_requests_waiting") == 0
            assert_vllm_names_match(scraped.text)

            # tool_choice "required": a JSON array of calls, each {"name": a tool, "parameters": its arguments}
            # and nothing else (vLLM's grammar for it admits no other key). This tiny model would repeat
            # calls forever at temperature 0, so 8 seeded samples: some end their array.
            required = client.chat.completions.create(model=name, messages=USER, tools=[WEATHER, CLOCK], n=8, seed=1,
                                                      tool_choice="required", temperature=1.0, max_tokens=96)
            called = [c for c in required.choices if c.message.tool_calls]
            assert called, f"no choice made a tool call: {[c.message.content for c in required.choices]}"
            for c in called:
                assert c.finish_reason == "tool_calls" and c.message.content is None
                for tool_call in c.message.tool_calls:
                    follows_schema(tool_call)
            for c in required.choices:  # the ones max_tokens cut: their text so far, item by item
                if not c.message.tool_calls:
                    assert c.finish_reason == "length"
                    extra = [hit.group(0) for hit in PARAMETERS_THEN.finditer(c.message.content)
                             if hit.group(1) not in ("}", "")]
                    assert not extra, (f"a call item holds keys besides name and parameters: {extra}"
                                       f" in {c.message.content!r}")
    finally:
        stopped = preload("stop", "--state-dir", state_dir, timeout=60)
        stop_everything(state_dir)
    assert stopped.returncode == 0, stopped.stderr
    assert daemon_processes(state_dir) == []
