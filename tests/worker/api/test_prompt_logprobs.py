"""A prompt's log-probs, in the two shapes clients read them, against a real worker.

What is specified:
- /v1/completions with `echo: true, logprobs: k, max_tokens: 0` (what lm-eval's
  loglikelihood sends): the prompt's text back, and per prompt token its text, its
  log-prob and a `top_logprobs` dict ({text: log-prob} of the k most likely there and of
  the token itself); the first token's entries are null (nothing predicts it, as in vLLM);
  no tokens generated.
- vLLM's `prompt_logprobs: k` on completions (per choice) and chat (top level): per
  prompt token {token id: {logprob, rank, decoded_token}} for the token itself and the k
  most likely (ranks 1..k), the first entry null. Both shapes say the same numbers, and
  chat's are those of its rendered prompt.
- prompt_logprobs outside [0, 20] is a 400 naming it; with echo and max_tokens > 0 the
  generated tokens follow the prompt's, with log-probs of their own.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from workers import bundled_model_ready, one_worker, sse_data

pytestmark = pytest.mark.skipif(not bundled_model_ready(), reason="needs the bundled model (it writes Python)")

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
TOL = 1e-5


@pytest.fixture(scope="module")
def worker(model, tmp_path_factory):
    with one_worker(model, tmp_path_factory, "prompt-logprobs") as w:
        yield w


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def ids(worker) -> list[int]:
    """The prompt's tokens as the server reads it (bos first)."""
    return ok(worker.post("/tokenize", {"prompt": PROMPT}))["tokens"]


def score(worker, k: int, prompt=PROMPT) -> dict:
    """lm-eval's loglikelihood request: the prompt echoed and scored, nothing generated."""
    return ok(worker.post("/v1/completions", {"prompt": prompt, "echo": True, "logprobs": k, "max_tokens": 0}))


def prompt_logprobs(worker, k: int, prompt=PROMPT) -> list:
    body = ok(worker.post("/v1/completions", {"prompt": prompt, "prompt_logprobs": k, "max_tokens": 1,
                                              "temperature": 0}))
    [choice] = body["choices"]
    assert choice["logprobs"] is None  # (not asked for)
    return choice["prompt_logprobs"]


# ---- echo + logprobs + max_tokens 0 -------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 5])
def test_scoring_a_prompt_gives_each_prompt_token_its_logprob_and_top_logprobs(worker, ids, k):
    body = score(worker, k)
    [choice] = body["choices"]
    assert choice["text"] == PROMPT
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    tokens, logprobs, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
    assert len(tokens) == len(logprobs) == len(tops) == len(lp["text_offset"]) == len(ids)
    assert logprobs[0] is None and tops[0] is None  # nothing predicts the first token (vLLM's shape)
    for token, logprob, top in zip(tokens[1:], logprobs[1:], tops[1:]):
        assert isinstance(logprob, float) and logprob <= 0
        assert isinstance(top, dict) and top.get(token) == logprob  # the token itself is always there
        assert k <= len(top) <= k + 1 and len(top) >= 1
        assert all(v <= 0 for v in top.values())
        if len(top) == k + 1:  # the token is not among the k most likely: it is less likely than each of them
            assert all(logprob <= v for t, v in top.items() if t != token)
    assert "".join(tokens[1:]) == PROMPT  # the tokens after bos spell the prompt


def test_scores_are_the_same_for_a_text_and_its_token_ids(worker, ids):
    by_text = score(worker, 2)["choices"][0]["logprobs"]
    by_ids = score(worker, 2, ids)["choices"][0]["logprobs"]
    assert by_ids["tokens"] == by_text["tokens"]
    assert max(abs(a - b) for a, b in zip(by_ids["token_logprobs"][1:], by_text["token_logprobs"][1:])) <= TOL


def test_a_greedy_continuation_is_the_top_logprob_everywhere(worker, ids):
    """What lm-eval's is_greedy reads: score the prompt plus its own greedy continuation;
    each continuation token is the most likely one at its place."""
    out = ok(worker.post("/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                             "logprobs": 0}))
    whole = ok(worker.post("/tokenize", {"prompt": PROMPT + out["choices"][0]["text"]}))["tokens"]
    assert whole[: len(ids)] == ids
    continuation = whole[len(ids):]
    assert len(continuation) == 6  # (the text tokenizes back to the tokens generated)
    lp = score(worker, 1, ids + continuation)["choices"][0]["logprobs"]
    for logprob, top in zip(lp["token_logprobs"][len(ids):], lp["top_logprobs"][len(ids):]):
        assert abs(logprob - max(top.values())) <= TOL


# ---- vLLM's prompt_logprobs -----------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_agree_with_echoed_logprobs(worker, ids, k):
    entries = prompt_logprobs(worker, k)
    echoed = score(worker, k)["choices"][0]["logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i, (token, entry) in enumerate(zip(ids[1:], entries[1:]), 1):
        mine = entry[str(token)]
        assert set(mine) == {"logprob", "rank", "decoded_token"}
        assert mine["decoded_token"] == echoed["tokens"][i]
        assert abs(mine["logprob"] - echoed["token_logprobs"][i]) <= TOL
        # The same candidates with the same log-probs, by text.
        assert set(echoed["top_logprobs"][i]) == {e["decoded_token"] for e in entry.values()}
        for e in entry.values():
            assert abs(e["logprob"] - echoed["top_logprobs"][i][e["decoded_token"]]) <= TOL


@pytest.mark.parametrize("k", [1, 4])
def test_prompt_logprob_ranks_are_consistent_with_the_top_k(worker, ids, k):
    entries = prompt_logprobs(worker, k)
    for token, entry in zip(ids[1:], entries[1:]):
        mine = entry[str(token)]
        others = {t: e for t, e in entry.items() if t != str(token)}
        top = sorted(entry.values(), key=lambda e: e["rank"])
        assert isinstance(mine["rank"], int) and mine["rank"] >= 1
        if mine["rank"] <= k:  # among the k most likely: k entries, ranks 1..k
            assert len(entry) == k and [e["rank"] for e in top] == list(range(1, k + 1))
        else:  # k others ranked 1..k, each more likely than the token
            assert len(entry) == k + 1 and sorted(e["rank"] for e in others.values()) == list(range(1, k + 1))
            assert all(e["logprob"] >= mine["logprob"] for e in others.values())
        ranked = [e for e in top if e["rank"] <= k]
        assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)
        assert sum(math.exp(e["logprob"]) for e in entry.values()) <= 1 + TOL  # probabilities of distinct tokens


def test_chat_prompt_logprobs_score_the_rendered_conversation(worker):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": PROMPT}]
    rendered = ok(worker.post("/tokenize", {"messages": messages}))["tokens"]
    body = ok(worker.post("/v1/chat/completions", {"messages": messages, "prompt_logprobs": 2, "max_tokens": 1}))
    entries = body["prompt_logprobs"]
    assert len(entries) == len(rendered) == body["usage"]["prompt_tokens"]
    assert entries[0] is None
    assert all(str(token) in entry for token, entry in zip(rendered[1:], entries[1:]))
    # The same prompt's tokens sent to completions: the same numbers.
    same = prompt_logprobs(worker, 2, rendered)
    for token, a, b in zip(rendered[1:], entries[1:], same[1:]):
        assert abs(a[str(token)]["logprob"] - b[str(token)]["logprob"]) <= TOL
        assert a[str(token)]["rank"] == b[str(token)]["rank"]


def test_prompt_logprobs_k_is_k_whatever_echo_asks(worker, ids):
    """vLLM: prompt_logprobs, when sent, is how many candidates a prompt token gets; an
    echo asking for more log-probs does not widen it."""
    body = ok(worker.post("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 4, "prompt_logprobs": 1,
                                              "max_tokens": 0}))
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:]):
        others = [e["rank"] for t, e in entry.items() if t != str(token)]
        assert len(entry) <= 2 and others in ([], [1]), entry


def test_chat_prompt_logprobs_in_a_stream_are_given_or_refused(worker):
    """vLLM refuses prompt_logprobs with stream (a 400); completions here gives them in the
    first chunk. Either way the client hears: never asked for and silently dropped."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "prompt_logprobs": 2, "max_tokens": 2, "stream": True}
    r = worker.post("/v1/chat/completions", body)
    if r.status_code == 400:
        assert "prompt_logprobs" in r.json()["error"]["message"]
        return
    assert r.status_code == 200, r.text
    chunks = [json.loads(c) for c in sse_data(r.text) if c != "[DONE]"]
    given = [c.get("prompt_logprobs") or (c["choices"] and c["choices"][0].get("prompt_logprobs")) for c in chunks]
    assert any(given), "prompt_logprobs asked for in a chat stream: neither refused nor given"


def test_completions_prompt_logprobs_in_a_stream_come_once_with_the_first_chunk(worker, ids):
    r = worker.post("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 3, "stream": True,
                                        "temperature": 0, "ignore_eos": True})
    if r.status_code == 400:  # (as vLLM: refused)
        assert "prompt_logprobs" in r.json()["error"]["message"]
        return
    chunks = [json.loads(c) for c in sse_data(r.text) if c != "[DONE]"]
    given = [c["choices"][0].get("prompt_logprobs") for c in chunks]
    assert given[0] is not None and not any(given[1:])
    whole = prompt_logprobs(worker, 2)
    assert len(given[0]) == len(whole) == len(ids)
    for token, a, b in zip(ids[1:], given[0][1:], whole[1:]):
        assert abs(a[str(token)]["logprob"] - b[str(token)]["logprob"]) <= TOL


def test_without_prompt_logprobs_there_are_none(worker):
    body = ok(worker.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}))
    assert "prompt_logprobs" not in body["choices"][0] or body["choices"][0]["prompt_logprobs"] is None
    chat = ok(worker.post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}))
    assert chat.get("prompt_logprobs") is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("k", [-1, 21])
def test_prompt_logprobs_out_of_range_is_a_400(worker, path, k):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    r = worker.post(path, body | {"prompt_logprobs": k, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert "prompt_logprobs" in r.json()["error"]["message"]


# ---- echo with generated tokens -------------------------------------------------------------


def test_echo_with_max_tokens_gives_the_prompt_then_the_generated_tokens_logprobs(worker, ids):
    k, n = 2, 4
    plain = ok(worker.post("/v1/completions", {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                               "logprobs": k}))["choices"][0]
    body = ok(worker.post("/v1/completions", {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                              "logprobs": k, "echo": True}))
    [choice] = body["choices"]
    assert choice["text"] == PROMPT + plain["text"]
    assert body["usage"]["completion_tokens"] == n
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][len(ids):] == plain["logprobs"]["tokens"]
    generated = lp["token_logprobs"][len(ids):]
    assert all(isinstance(v, float) and v <= 0 for v in generated)
    assert max(abs(a - b) for a, b in zip(generated, plain["logprobs"]["token_logprobs"])) <= TOL
    for logprob, top in zip(generated, lp["top_logprobs"][len(ids):]):
        assert len(top) == k and abs(logprob - max(top.values())) <= TOL  # greedy: the most likely
    # The prompt's part is what scoring alone gives.
    scored = score(worker, k)["choices"][0]["logprobs"]
    assert lp["tokens"][: len(ids)] == scored["tokens"]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1: len(ids)], scored["token_logprobs"][1:])) <= TOL


def test_streamed_echo_gives_the_prompts_logprobs_first_once(worker, ids):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 1, "echo": True}
    whole = ok(worker.post("/v1/completions", body))["choices"][0]
    r = worker.post("/v1/completions", body | {"stream": True})
    assert r.status_code == 200
    chunks = [c for c in sse_data(r.text) if c != "[DONE]"]
    choices = [json.loads(c)["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == whole["text"]
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    logprobs = [v for c in choices for v in c["logprobs"]["token_logprobs"]]
    assert tokens == whole["logprobs"]["tokens"]
    assert logprobs[0] is None and logprobs.count(None) == 1
    assert max(abs(a - b) for a, b in zip(logprobs[1:], whole["logprobs"]["token_logprobs"][1:])) <= TOL
