"""A worker serving with speculative decoding (`preload serve --speculative-config`, the
bundled model's MTP layer, 2 drafts a step), as its clients see it over HTTP: with the
operator's logits processors (BanTokens) its greedy answers are exactly those of a worker
with the processors alone (and of the engine in-process with them, whose answers hold no
banned token), requests that cannot draft (log-probs) share its steps and give the same
answers, a stream's chunks are the whole answer, and /metrics counts the drafts it made and
the ones accepted."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from daemons import metrics, running_daemon, total
from workers import greedy, joined, ok, running_workers, stream_chunks

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], list(range(100, 140)), [9] * 20]
BAN = "preload.worker.engine.logits_processors:BanTokens"
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
TOKENS = 24
OPTIONS = EngineOptions(kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def answers():
    """In-process, the same engine on the same float32 weights (the oracle): the banned ids
    (tokens the plain answers pick), and the answers with them banned, which differ."""
    plain = LLM(BUNDLED_MODEL, dtype="float32", engine=OPTIONS).generate(PROMPTS, max_tokens=TOKENS, ignore_eos=True)
    banned = sorted({t for a in plain for t in a.token_ids[2:5]})
    processor = f'{BAN}={{"token_ids": {banned}}}'
    alone = LLM(BUNDLED_MODEL, dtype="float32", engine=replace(OPTIONS, logits_processors=(processor,)))
    with_ban = alone.generate(PROMPTS, max_tokens=TOKENS, ignore_eos=True)
    assert [a.token_ids for a in with_ban] != [a.token_ids for a in plain]  # the ban changes the answers
    assert not any(set(a.token_ids) & set(banned) for a in with_ban)
    return {"processor": processor, "texts": [a.text for a in with_ban]}


@pytest.fixture(scope="module")
def workers(answers, tmp_path_factory):
    """{"alone": a worker with the processor, "drafting": with it and 2 MTP drafts a step}."""
    ban = ("--logits-processors", answers["processor"])
    with running_daemon(tmp_path_factory.mktemp("spec") / "state", Path(BUNDLED_MODEL), "--dtype", "float32") as d, \
            running_workers(d.state_dir, tmp_path_factory.mktemp("logs"), ban,
                            (*ban, "--speculative-config", MTP)) as (alone, drafting):
        yield {"alone": alone, "drafting": drafting}


def text(worker, prompt, **extra) -> str:
    return ok(worker.post("/v1/completions", greedy(prompt, TOKENS, **extra)))["choices"][0]["text"]


def test_drafting_with_a_processor_gives_the_processors_answers_alone(answers, workers):
    assert [text(workers["alone"], p) for p in PROMPTS] == answers["texts"]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # the requests in one batch
        assert list(pool.map(lambda p: text(workers["drafting"], p), PROMPTS)) == answers["texts"]


def test_requests_that_cannot_draft_share_the_steps_and_give_the_same_answers(answers, workers):
    """A request asking for log-probs is answered from the target's logits a token at a
    time: it runs without drafts in the steps of requests that draft."""
    with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
        drafting = [pool.submit(text, workers["drafting"], p) for p in PROMPTS]
        scored = [pool.submit(text, workers["drafting"], p, logprobs=2) for p in PROMPTS]
        assert [f.result() for f in drafting] == answers["texts"]
        assert [f.result() for f in scored] == answers["texts"]


def test_a_drafted_stream_is_the_whole_answer_once(answers, workers):
    chunks = stream_chunks(workers["drafting"].post("/v1/completions", greedy(PROMPTS[2], TOKENS, stream=True)))
    assert joined(chunks) == ([answers["texts"][2]], ["length"])


def test_metrics_count_the_drafts_and_those_accepted(workers):
    text(workers["drafting"], PROMPTS[0])
    m = metrics(workers["drafting"].get("/metrics").text)
    drafts = total(m, "preload_spec_decode_num_draft_tokens_total")
    accepted = total(m, "preload_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafts  # the bundled model's MTP layer is trained: right often
