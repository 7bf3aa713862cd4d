"""vLLM's request parameters, honoured as vLLM documents them, against a real worker.

What is specified:
- `min_p`: a sampled token is never less likely than min_p times the most likely token
  (checked on the returned log-probs); min_p 1 is greedy; outside [0, 1] a 400 naming it.
- `include_stop_str_in_output`: the stop string ends the text, kept (true) or cut (false,
  the default), whole or streamed.
- `skip_special_tokens`: special tokens' text is left out (the default) or kept (false).
- `stream_options: {include_usage, continuous_usage_stats}`: usage in every chunk, its
  completion_tokens growing to the total; include_usage alone: usage in a last chunk only.
- `suffix` is refused (a 400), as vLLM refuses it.
- `usage.prompt_tokens_details.cached_tokens`: 0 on a first request, whole blocks (16
  tokens) on a repeat of a long prompt (the prefix cache); `cache_salt` keeps them apart.
"""

from __future__ import annotations

import json
import math
import uuid

import httpx
import pytest
from workers import bundled_model_ready, one_worker, sse_data

pytestmark = pytest.mark.skipif(not bundled_model_ready(), reason="needs the bundled model (it writes Python)")

PROMPT = "import os\n\ndef main("
C, CH = "/v1/completions", "/v1/chat/completions"
BLOCK = 16  # the default --block-size


@pytest.fixture(scope="module")
def worker(model, tmp_path_factory):
    with one_worker(model, tmp_path_factory, "request-options") as w:
        yield w


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def chunks(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- min_p ------------------------------------------------------------------------------------


def sampled(worker, **extra) -> list[tuple[float, float]]:
    """(log-prob of each sampled token, log-prob of the most likely token there), over 4
    seeded choices of 24 tokens at temperature 1."""
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 7, "n": 4, "logprobs": 5,
            "ignore_eos": True} | extra
    out = []
    for choice in ok(worker.post(C, body))["choices"]:
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == 24
        out += [(v, max(top.values())) for v, top in zip(lp["token_logprobs"], lp["top_logprobs"])]
    return out


@pytest.mark.parametrize("min_p", [0.1, 0.3, 0.6])
def test_min_p_never_samples_a_token_less_likely_than_min_p_times_the_most_likely(worker, min_p):
    floor = math.log(min_p)
    assert all(v - best >= floor - 1e-4 for v, best in sampled(worker, min_p=min_p))
    # The same draws without min_p do take such tokens: the check above can fail.
    assert any(v - best < floor for v, best in sampled(worker))


def test_min_p_1_is_greedy(worker):
    body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True}
    greedy = ok(worker.post(C, body | {"temperature": 0}))["choices"][0]["text"]
    for seed in (1, 2):
        got = ok(worker.post(C, body | {"temperature": 1.0, "min_p": 1.0, "seed": seed}))["choices"][0]["text"]
        assert got == greedy


def test_min_p_applies_to_chat_too(worker):
    body = {"messages": user(PROMPT), "max_tokens": 24, "temperature": 1.0, "seed": 3, "n": 4, "logprobs": True,
            "top_logprobs": 5, "ignore_eos": True, "min_p": 0.3}
    for choice in ok(worker.post(CH, body))["choices"]:
        for entry in choice["logprobs"]["content"]:
            best = max(t["logprob"] for t in entry["top_logprobs"])
            assert entry["logprob"] - best >= math.log(0.3) - 1e-4


@pytest.mark.parametrize("path", [C, CH, "/v1/responses"])
@pytest.mark.parametrize("min_p", [-0.1, 1.5])
def test_min_p_outside_0_1_is_a_400(worker, path, min_p):
    body = {C: {"prompt": PROMPT}, CH: {"messages": user(PROMPT)}, "/v1/responses": {"input": PROMPT}}[path]
    r = worker.post(path, body | {"min_p": min_p})
    assert r.status_code == 400, r.text
    assert "min_p" in r.json()["error"]["message"]


# ---- include_stop_str_in_output ---------------------------------------------------------------


@pytest.fixture(scope="module")
def full_and_stop(worker) -> tuple[str, str]:
    """A greedy completion and a stop string from its middle (part of a token: stop strings
    match text, not tokens)."""
    out = ok(worker.post(C, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                             "logprobs": 0}))["choices"][0]
    pieces = out["logprobs"]["tokens"]
    start = len("".join(pieces[:4]))
    piece = next(p.strip() for p in pieces[4:] if len(p.strip()) >= 2)
    stop = piece[: max(2, len(piece) - 1)]
    assert out["text"].find(stop, start) >= 0
    return out["text"], stop


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_keeps_or_cuts_the_stop_string(worker, full_and_stop, include, stream):
    full, stop = full_and_stop
    end = full.find(stop) + (len(stop) if include else 0)
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop], "stream": stream}
    if include:
        body["include_stop_str_in_output"] = True
    r = worker.post(C, body)
    if stream:
        choices = [c["choices"][0] for c in chunks(r)]
        text, finish = "".join(c["text"] for c in choices), [c["finish_reason"] for c in choices if c["finish_reason"]]
    else:
        [choice] = ok(r)["choices"]
        text, finish = choice["text"], [choice["finish_reason"]]
    assert text == full[:end]
    assert finish == ["stop"]
    assert text.endswith(stop) == include


def test_include_stop_str_in_output_in_chat(worker):
    body = {"messages": user(PROMPT), "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = ok(worker.post(CH, body))["choices"][0]["message"]["content"]
    stop = full.strip()[3:6]
    assert len(stop) == 3 and stop in full
    kept = ok(worker.post(CH, body | {"stop": stop, "include_stop_str_in_output": True}))["choices"][0]
    cut = ok(worker.post(CH, body | {"stop": stop}))["choices"][0]
    assert kept["message"]["content"] == full[: full.find(stop) + len(stop)]
    assert cut["message"]["content"] == full[: full.find(stop)]
    assert kept["finish_reason"] == cut["finish_reason"] == "stop"


# ---- skip_special_tokens ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def special(model) -> tuple[int, str]:
    """A special token of the served tokenizer that is neither bos nor eos (nothing stops at it)."""
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    config = json.loads((model / "tokenizer_config.json").read_text())
    ends = {config["bos_token"], config["eos_token"], config.get("pad_token")}
    token = next(t for t in tokenizer["added_tokens"] if t["special"] and t["content"] not in ends)
    return token["id"], token["content"]


@pytest.mark.parametrize("path", [C, CH])
def test_skip_special_tokens_false_keeps_special_tokens_text(worker, special, path):
    token, text = special
    body = {"max_tokens": 3, "temperature": 0, "logit_bias": {str(token): 100}}
    body |= {"prompt": PROMPT} if path == C else {"messages": user(PROMPT)}

    def reply(extra: dict) -> tuple[str, int]:
        out = ok(worker.post(path, body | extra))
        choice = out["choices"][0]
        return (choice["text"] if path == C else choice["message"]["content"]), out["usage"]["completion_tokens"]

    assert reply({"skip_special_tokens": False}) == (text * 3, 3)
    assert reply({}) == ("", 3)  # the default: generated, counted, not shown
    assert reply({"skip_special_tokens": True}) == ("", 3)


def test_skip_special_tokens_false_when_streamed(worker, special):
    token, text = special
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logit_bias": {str(token): 100}, "stream": True}
    kept = "".join(c["choices"][0]["text"] for c in chunks(worker.post(C, body | {"skip_special_tokens": False})))
    skipped = "".join(c["choices"][0]["text"] for c in chunks(worker.post(C, body)))
    assert (kept, skipped) == (text * 3, "")


# ---- stream_options -------------------------------------------------------------------------


@pytest.mark.parametrize("path", [C, CH])
def test_continuous_usage_stats_put_usage_in_every_chunk(worker, path):
    n = 6
    body = {"max_tokens": n, "temperature": 0, "ignore_eos": True}
    body |= {"prompt": PROMPT} if path == C else {"messages": user(PROMPT)}
    prompt_tokens = ok(worker.post(path, body))["usage"]["prompt_tokens"]
    got = chunks(worker.post(path, body | {"stream": True,
                                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    # (chat's first chunk, the role's, too: vLLM gives it completion_tokens 0)
    assert all(c.get("usage") for c in got), [c["choices"] for c in got if not c.get("usage")]
    usages = [c["usage"] for c in got]
    assert all(u["prompt_tokens"] == prompt_tokens for u in usages)
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == n
    assert len(set(done)) > 2  # it grows chunk by chunk, not only at the end
    assert got[-1]["choices"] == []  # include_usage's last chunk: the usage alone


@pytest.mark.parametrize("path", [C, CH])
def test_include_usage_alone_puts_usage_in_a_last_chunk_only(worker, path):
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    body |= {"prompt": PROMPT} if path == C else {"messages": user(PROMPT)}
    got = chunks(worker.post(path, body | {"stream_options": {"include_usage": True}}))
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 4
    assert all(c.get("usage") is None for c in got[:-1])
    plain = chunks(worker.post(path, body))
    assert all(c.get("usage") is None for c in plain)


# ---- suffix -----------------------------------------------------------------------------------


def test_suffix_is_refused(worker):
    r = worker.post(C, {"prompt": PROMPT, "suffix": "\n    return 0\n", "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert "suffix" in r.json()["error"]["message"]


# ---- cached_tokens ----------------------------------------------------------------------------


def long_prompt() -> str:
    """A prompt of well over a few blocks that no other request shares."""
    tag = uuid.uuid4().hex[:8]
    return "\n".join(f"import module_{tag}_{i} as alias_{i}" for i in range(12))


@pytest.mark.parametrize("path", [C, CH])
def test_cached_tokens_are_0_first_then_whole_blocks_of_a_repeated_prompt(worker, path):
    text = long_prompt()
    body = {"max_tokens": 2, "temperature": 0}
    body |= {"prompt": text} if path == C else {"messages": user(text)}
    first = ok(worker.post(path, body))["usage"]
    again = ok(worker.post(path, body))["usage"]
    assert first["prompt_tokens"] == again["prompt_tokens"] > 4 * BLOCK
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert BLOCK <= cached < again["prompt_tokens"] and cached % BLOCK == 0
    assert cached >= (again["prompt_tokens"] - 1) // BLOCK * BLOCK - BLOCK  # all but the last block or two
    # Streamed, the last chunk's usage says the same.
    streamed = chunks(worker.post(path, body | {"stream": True, "stream_options": {"include_usage": True}}))
    assert streamed[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


def test_a_different_cache_salt_shares_no_cached_tokens(worker):
    body = {"prompt": long_prompt(), "max_tokens": 2, "temperature": 0}
    ok(worker.post(C, body | {"cache_salt": "tenant-a"}))
    same = ok(worker.post(C, body | {"cache_salt": "tenant-a"}))["usage"]["prompt_tokens_details"]["cached_tokens"]
    other = ok(worker.post(C, body | {"cache_salt": "tenant-b"}))["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert same >= BLOCK and other == 0
