"""A step's forward never waits for the GPU: what the host sends the device on the way (the
tokens, the step's layout, the rows whose logits count) is queued behind the work before it
(worker/model/host_values.py). A copy from pageable memory waits for all of that work, and
the GPU then idles through every launch the host makes after it: the head, the log-softmax,
sampling, up to the one wait a step has, for the tokens it drew. torch's sync debug mode
makes every wait an error; here it watches the forward of prompt steps, mixed steps
(prompt chunks beside decode rows) and a draft model's steps.

Run on the GPU machine with `python3 -m pytest -m gpu -q`; skipped where CUDA is absent.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions

pytestmark = pytest.mark.gpu

PROMPTS = [list(range(5, 5 + n)) for n in (40, 100, 7, 300)]


def watched(owner, name: str) -> list[int]:
    """Every call of `owner.name` from now on runs with a wait for the GPU an error; how many ran."""
    method, calls = getattr(owner, name), []

    def without_waits(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            calls.append(1)

    setattr(owner, name, without_waits)
    return calls


# (no prefix caching: the second run computes its prompts again, as the first did)
UNCACHED = EngineOptions(kv_cache_memory=64 << 20, enable_prefix_caching=False)


@pytest.mark.parametrize("options", [UNCACHED, replace(UNCACHED, max_num_batched_tokens=64)],
                         ids=["prompts-whole", "chunked-beside-decode-rows"])
def test_a_steps_forward_never_waits_for_the_gpu(options):
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=options)
    want = llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)  # (captures what such steps replay)
    calls = watched(llm.engine, "forward")
    got = llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(calls) >= 8


def test_a_draft_models_steps_and_the_verify_steps_never_wait_for_the_gpu():
    """The drafter's steps too (the catch-up and the chained drafts, left on the device), and
    the verify steps that read the drafts there; the step's one wait is the judging's copy."""
    spec = json.dumps({"method": "draft_model", "model": str(Path(BUNDLED_MODEL).parent / "tiny-v3-draft"),
                       "num_speculative_tokens": 2})
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=EngineOptions(kv_cache_memory=64 << 20, speculative_config=spec))
    want = llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)
    steps, drafts = watched(llm.engine, "forward"), watched(llm.engine.drafter, "draft")
    got = llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(steps) >= 4 and len(drafts) >= 4


def test_a_step_launched_ahead_never_waits_for_the_gpu():
    """The whole launch of a step ahead of the last one's landing (pipeline.py): its inputs
    (the host's prompt chunks, the last step's draws copied in on the device), the forward,
    the draws and their copy queued; prompt chunks beside decode rows among them. The step's
    one wait is its landing's, for the copy."""
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=replace(UNCACHED, max_num_batched_tokens=64))
    want = llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)
    pipeline, mixed = llm.engine.pipeline, []
    launch = pipeline._launch
    pipeline._launch = lambda batch, before: (
        mixed.append(before is not None and any(n > 1 for _, n in batch) and any(n == 1 for _, n in batch)),
        launch(batch, before))[1]
    calls = watched(pipeline, "_launch")
    got = llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(calls) >= 8 and any(mixed)


def watched_against_one_step_at_a_time(params: dict, method: str) -> int:
    """Generate PROMPTS with `params` one step at a time, then with steps launched ahead and
    the pipeline's `method` never waiting for the GPU: the same tokens; how often it ran."""
    llm = LLM(BUNDLED_MODEL, device="cuda", engine=UNCACHED)
    pipeline, llm.engine.pipeline = llm.engine.pipeline, None
    want = llm.generate(PROMPTS, **params)
    llm.engine.pipeline = pipeline
    calls = watched(pipeline, method)
    got = llm.generate(PROMPTS, **params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    return len(calls)


def test_a_penalized_step_launched_ahead_never_waits_for_the_gpu():
    """Penalties, repetition penalty, logit bias and min_tokens count the token still in
    flight from the device (sampler.py): such requests are launched ahead too, with no wait,
    and draw what steps one at a time draw."""
    params = dict(max_tokens=8, ignore_eos=True, presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3,
                  logit_bias=((7, 2.0),), min_tokens=3)
    assert watched_against_one_step_at_a_time(params, "_launch") >= 8


def test_a_late_draw_never_waits_for_the_gpu():
    """Draws that read the host (a grammar's matcher) are made once the step before has
    landed, while the GPU computes their step's forward (pipeline.py): the masks go to the
    device queued, with no wait, and the tokens are those of steps one at a time."""
    from preload.worker.engine.grammar import regex_grammar

    params = dict(max_tokens=8, ignore_eos=True, grammar=regex_grammar("[a-z ]+"), temperature=0.7, seed=3)
    assert watched_against_one_step_at_a_time(params, "_draw") >= 7
