"""The worker's OpenAI-compatible API through real processes: a daemon from `preload
start`, workers from `preload serve`, driven by httpx and by the official `openai`
client. Completions (text, token ids, lists; streamed and not), chat, echo + logprobs
against the in-process `LLM`, 32 concurrent requests, preemption under a tiny KV
budget.

One daemon (float32) and two workers are shared by the module: `main` with the
defaults, `small` with a KV budget of 24 blocks of 4 tokens, a served-model-name and
--trust-request-chat-template. Disconnects, /health, keep-alive and /metrics are in
test_server_health.py; bad input in test_server_errors.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jinja2.sandbox
import pytest
import torch
from daemons import total
from openai import OpenAI
from workers import FIRST_ID, greedy, ids, joined, ok, running_workers, stream_chunks

from preload import BUNDLED_MODEL, LLM
from preload.checkpoint.config import ModelConfig
from preload.checkpoint.tokenizer import Tokenizer
from preload.worker.model.kv_cache import bytes_per_token

SMALL_BLOCKS, SMALL_BLOCK_SIZE = 24, 4
SERVED_NAME = "tiny-served"
ALIAS = "tiny-alias"  # a second --served-model-name



def counts(usage: dict) -> dict:
    """A usage's token counts (prompt_tokens_details.cached_tokens depends on what ran before)."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


# ---- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config(model) -> dict:
    return json.loads((model / "config.json").read_text())


@pytest.fixture(scope="module")
def tok(model) -> Tokenizer:
    return Tokenizer.from_dir(model)


def small_kv_budget(model: Path) -> int:
    """Bytes that hold exactly SMALL_BLOCKS blocks of SMALL_BLOCK_SIZE float32 latents."""
    cfg = ModelConfig.from_dir(model)
    return SMALL_BLOCKS * SMALL_BLOCK_SIZE * bytes_per_token(cfg, cfg.num_layers, torch.float32)


@pytest.fixture(scope="module")
def workers(daemon, model, tmp_path_factory):
    small = ("--kv-cache-memory", small_kv_budget(model), "--block-size", SMALL_BLOCK_SIZE,
             "--served-model-name", SERVED_NAME, "--served-model-name", ALIAS, "--trust-request-chat-template")
    with running_workers(daemon.state_dir, tmp_path_factory.mktemp("worker-logs"), (), small) as (main, small_worker):
        yield main, small_worker


@pytest.fixture(scope="module")
def worker(workers):
    return workers[0]


@pytest.fixture(scope="module")
def small(workers):
    return workers[1]


@pytest.fixture(scope="module")
def client(worker) -> OpenAI:
    return OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(model):
    """The same checkpoint in this process, float32 like the daemon: the oracle."""
    return LLM(model, dtype="float32")


@pytest.fixture(scope="module")
def ctx(worker) -> int:
    return worker.get("/v1/models").json()["data"][0]["max_model_len"]


def sample_text(model: Path) -> str:
    if model.resolve() == Path(BUNDLED_MODEL).resolve():
        return "def fibonacci(n):\n    if n < 2:\n        return n\n"
    return "t5 t17 t33 t8 t61 t12 t40"


def render_chat(model: Path, messages: list[dict], template: str | None = None, **kw) -> str:
    """The chat prompt as transformers renders it (jinja2 sandbox, trim + lstrip blocks)."""
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def special(name):
        v = cfg.get(name)
        return v.get("content") if isinstance(v, dict) else (v or "")

    return env.from_string(template or cfg["chat_template"]).render(
        messages=messages, add_generation_prompt=True, bos_token=special("bos_token"), eos_token=special("eos_token"), **kw
    )


# ---- /v1/models -----------------------------------------------------------------------------


def test_models_lists_the_checkpoint_dir_name(worker, client, model, config):
    body = ok(worker.get("/v1/models"))
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [model.name]
    assert body["data"][0]["max_model_len"] == config["max_position_embeddings"]  # the big budget holds it all
    assert [m.id for m in client.models.list().data] == [model.name]


def test_served_model_names_replace_the_id(small, model):
    """Each --served-model-name is served; responses name the first, as vLLM's do."""
    assert [m["id"] for m in ok(small.get("/v1/models"))["data"]] == [SERVED_NAME, ALIAS]
    assert ok(small.get(f"/v1/models/{ALIAS}"))["id"] == ALIAS
    for name in (SERVED_NAME, ALIAS):
        assert ok(small.post("/v1/completions", greedy([FIRST_ID], 2, model=name)))["model"] == SERVED_NAME
    r = small.post("/v1/completions", greedy([FIRST_ID], 2, model=model.name))
    assert r.status_code == 404 and r.json()["error"]["type"]


# ---- /v1/completions ------------------------------------------------------------------------


def test_completion_text_prompt(worker, client, model, tok):
    text = sample_text(model)
    body = ok(worker.post("/v1/completions", greedy(text, 8)))
    assert body["object"] == "text_completion" and body["model"] == model.name and body["id"]
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["text"]
    n_prompt = len(tok.encode(text))
    assert counts(body["usage"]) == {"prompt_tokens": n_prompt, "completion_tokens": 8, "total_tokens": n_prompt + 8}
    # The openai client gets the same greedy text.
    out = client.completions.create(model=model.name, prompt=text, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == choice["text"]
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, 8)


def test_completion_token_id_prompt_equals_its_text(worker, client, model, tok):
    text = sample_text(model)
    prompt = tok.encode(text)
    by_ids = ok(worker.post("/v1/completions", greedy(prompt, 8)))
    by_text = ok(worker.post("/v1/completions", greedy(text, 8)))
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(prompt)
    out = client.completions.create(model=model.name, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == by_ids["choices"][0]["text"]


def test_completion_list_of_prompts(worker, vocab, model):
    prompts = [ids(n, seed, vocab) for seed, n in enumerate((3, 11, 6))]
    alone = [ok(worker.post("/v1/completions", greedy(p, 6)))["choices"][0]["text"] for p in prompts]
    body = ok(worker.post("/v1/completions", greedy(prompts, 6)))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == alone
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 3
    assert counts(body["usage"]) == {"prompt_tokens": 20, "completion_tokens": 18, "total_tokens": 38}
    # A list of strings too.
    texts = [sample_text(model), sample_text(model)[:-3] or "x"]
    body = ok(worker.post("/v1/completions", greedy(texts, 4)))
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 8


def test_streamed_completion_equals_non_streamed(worker, vocab, model):
    prompt = ids(9, 1, vocab)
    whole = ok(worker.post("/v1/completions", greedy(prompt, 10)))
    r = worker.post("/v1/completions", greedy(prompt, 10, stream=True, stream_options={"include_usage": True}))
    chunks = stream_chunks(r)
    *token_chunks, last = chunks
    assert last["choices"] == [] and counts(last["usage"]) == {"prompt_tokens": 9, "completion_tokens": 10, "total_tokens": 19}
    assert all(c["object"] == "text_completion" and c["model"] == model.name for c in chunks)
    assert len({c["id"] for c in token_chunks}) == 1
    texts, reasons = joined(token_chunks)
    assert texts == [whole["choices"][0]["text"]] and reasons == ["length"]
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"  # the finish comes last
    # Without stream_options there is no usage chunk.
    chunks = stream_chunks(worker.post("/v1/completions", greedy(prompt, 10, stream=True)))
    assert all(c["choices"] for c in chunks) and "usage" not in chunks[-1]
    assert joined(chunks)[0] == texts


def test_streamed_list_of_prompts(worker, vocab):
    prompts = [ids(n, 10 + n, vocab) for n in (4, 13)]
    whole = ok(worker.post("/v1/completions", greedy(prompts, 7)))
    r = worker.post("/v1/completions", greedy(prompts, 7, stream=True, stream_options={"include_usage": True}))
    *chunks, usage = stream_chunks(r)
    texts, reasons = joined(chunks, 2)
    assert texts == [c["text"] for c in whole["choices"]]
    assert reasons == ["length", "length"]
    assert counts(usage["usage"]) == {"prompt_tokens": 17, "completion_tokens": 14, "total_tokens": 31}


def test_openai_client_streams_completions(client, worker, vocab, model):
    prompt = ids(7, 2, vocab)
    whole = ok(worker.post("/v1/completions", greedy(prompt, 9)))["choices"][0]["text"]
    stream = client.completions.create(model=model.name, prompt=prompt, max_tokens=9, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == 7


def test_finish_reason_stop_on_stop_token_and_stop_string(worker, llm, vocab):
    prompt = ids(6, 3, vocab)
    full = ok(worker.post("/v1/completions", greedy(prompt, 12)))["choices"][0]
    assert full["finish_reason"] == "length"
    # The same greedy ids in-process (same float32 weights), to name a stop token.
    out = llm.generate([prompt], max_tokens=12, ignore_eos=True)[0].token_ids
    stop_id = out[3]
    first = out.index(stop_id)
    body = ok(worker.post("/v1/completions", greedy(prompt, 12, stop_token_ids=[stop_id])))
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == first + 1  # the stop token is generated, then generation ends
    assert full["text"].startswith(body["choices"][0]["text"])
    # A stop string: the text is cut before its first occurrence.
    pieces = ok(worker.post("/v1/completions", greedy(prompt, 12, logprobs=0)))["choices"][0]["logprobs"]["tokens"]
    piece = next(t.strip() for t in pieces[3:] if t.strip())
    cut = ok(worker.post("/v1/completions", greedy(prompt, 12, stop=[piece])))["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full["text"][: full["text"].find(piece)]
    # Streamed, the stop string never leaks out before the cut.
    texts, reasons = joined(stream_chunks(worker.post("/v1/completions", greedy(prompt, 12, stop=[piece], stream=True))))
    assert texts == [cut["text"]] and reasons == ["stop"]


def test_echo_logprobs_equal_in_process_prompt_logprobs(worker, llm, vocab, model, tok):
    for prompt in (ids(40, 4, vocab), tok.encode(sample_text(model))):
        want = llm.generate([prompt], max_tokens=1, prompt_logprobs=True)[0].prompt_logprobs
        body = ok(worker.post("/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}))
        [choice] = body["choices"]
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(prompt) == len(want)
        assert got[0] is None and want[0] is None
        assert max(abs(a - b) for a, b in zip(got[1:], want[1:])) <= 1e-5
        assert choice["text"] == tok.decode(prompt)
        assert len(choice["logprobs"]["tokens"]) == len(prompt)
        assert counts(body["usage"]) == {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)}


# ---- /v1/chat/completions -------------------------------------------------------------------


def test_chat_non_streamed_and_streamed(client, worker, model, tok):
    messages = [{"role": "system", "content": sample_text(model)[:12]}, {"role": "user", "content": sample_text(model)}]
    n_prompt = len(tok.encode(render_chat(model, messages), add_special_tokens=False))
    out = client.chat.completions.create(model=model.name, messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.model == model.name
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n_prompt, 8, n_prompt + 8)

    stream = client.chat.completions.create(model=model.name, messages=messages, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.prompt_tokens == n_prompt and chunks[-1].usage.completion_tokens == 8

    # The raw SSE stream ends with [DONE]; a non-streamed httpx call agrees with the client.
    r = worker.post("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True})
    raw = stream_chunks(r)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in raw) == choice.message.content
    body = ok(worker.post("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}))
    assert body["choices"][0]["message"]["content"] == choice.message.content


def test_chat_finish_reason_stop_and_logprobs(worker, model):
    messages = [{"role": "user", "content": sample_text(model)}]
    full = ok(worker.post("/v1/chat/completions", {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                                                   "logprobs": True, "top_logprobs": 2}))
    content = full["choices"][0]["logprobs"]["content"]
    assert len(content) == 10 and all(len(e["top_logprobs"]) == 2 for e in content)
    piece = next(e["token"].strip() for e in content[3:] if e["token"].strip())
    text = full["choices"][0]["message"]["content"]
    cut = ok(worker.post("/v1/chat/completions", {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                                                  "stop": piece}))
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == text[: text.find(piece)]


def test_request_chat_template_accepted_when_trusted(small, model, tok):
    messages = [{"role": "user", "content": sample_text(model)}]
    template = "{{ prefix }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    prefix = sample_text(model)[:10]
    body = ok(small.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "chat_template": template,
                                                   "chat_template_kwargs": {"prefix": prefix}}))
    want = len(tok.encode(render_chat(model, messages, template, prefix=prefix), add_special_tokens=False))
    assert want != len(tok.encode(render_chat(model, messages), add_special_tokens=False))  # so the check means something
    assert body["usage"]["prompt_tokens"] == want
    # Still sandboxed: a template that reaches for Python internals is a 400, not a 500.
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    r = small.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "chat_template": escape})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = small.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "chat_template": "{% for %}"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    ok(small.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2}))


# ---- batching -------------------------------------------------------------------------------


async def post_all(url: str, bodies: list[dict], path: str = "/v1/completions") -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        return await asyncio.gather(*(c.post(path, json=b) for b in bodies))


def test_32_concurrent_requests_match_their_greedy_text_alone(worker, vocab):
    # 8 distinct prompts of different lengths, 4 copies each: the batch mixes prefills and decodes.
    prompts = [ids(3 + 5 * i, 100 + i, vocab) for i in range(8)]
    alone = [ok(worker.post("/v1/completions", greedy(p, 12)))["choices"][0]["text"] for p in prompts]
    bodies = [greedy(prompts[i % 8], 12) for i in range(32)]
    responses = asyncio.run(post_all(worker.url, bodies))
    assert [r.status_code for r in responses] == [200] * 32, [r.text for r in responses if r.status_code != 200][:2]
    for i, r in enumerate(responses):
        body = r.json()
        assert body["usage"]["completion_tokens"] == 12
        assert body["choices"][0]["text"] == alone[i % 8], f"request {i} differs inside the batch"
    m = worker.metrics()
    assert total(m, "preload_kv_blocks_used") == 0 and total(m, "preload_num_requests_running") == 0


def test_preemption_under_tiny_kv_budget_keeps_outputs(worker, small, vocab):
    m = small.metrics()
    assert total(m, "preload_kv_blocks_total") == SMALL_BLOCKS
    assert ok(small.get("/v1/models"))["data"][0]["max_model_len"] == SMALL_BLOCKS * SMALL_BLOCK_SIZE
    preempted_before = total(m, "preload_num_preemptions_total")
    # 8 requests of ~10 blocks each against 24 blocks: most of them are preempted, some
    # more than once, and come back. Two also score their prompt (echo + logprobs).
    bodies = [greedy(ids(8 + i, 200 + i, vocab), 32, logprobs=0, echo=i in (2, 5)) for i in range(8)]
    want = asyncio.run(post_all(worker.url, bodies))
    got = asyncio.run(post_all(small.url, bodies))
    for i, (w, g) in enumerate(zip(want, got)):
        assert w.status_code == 200 and g.status_code == 200, (w.text, g.text)
        cw, cg = w.json()["choices"][0], g.json()["choices"][0]
        assert cg["text"] == cw["text"], f"request {i} changed under preemption"
        assert cg["finish_reason"] == "length"
        assert cg["logprobs"]["tokens"] == cw["logprobs"]["tokens"]
        lw, lg = cw["logprobs"]["token_logprobs"], cg["logprobs"]["token_logprobs"]
        assert len(lg) == len(lw) == (8 + i) * bodies[i]["echo"] + 32
        assert all((a is None) == (b is None) for a, b in zip(lw, lg))
        assert max(abs(a - b) for a, b in zip(lw, lg) if a is not None) <= 1e-4
        assert g.json()["usage"] == w.json()["usage"]
    m = small.metrics()
    assert total(m, "preload_num_preemptions_total") > preempted_before
    assert total(m, "preload_kv_blocks_used") == 0 and total(m, "preload_num_requests_running") == 0 and total(m, "preload_num_requests_waiting") == 0
