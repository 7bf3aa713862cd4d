"""FP8 keeps the bundled model's quality: held-out perplexity within 5% of full
precision for both fp8 modes (asserted), and how often the greedy continuation of a
held-out prompt is the same as full precision's (reported; see it with -s or -rA).

Runs in-process (`LLM(BUNDLED_MODEL, quant=...)`), which quantizes with the daemon's
code; that an attached LLM computes exactly the same is tests/worker/test_attach.py's job.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from preload import BUNDLED_MODEL, LLM

HELDOUT = Path(__file__).parents[1] / "data" / "heldout.txt"
FP8_MODES = ("fp8_per_tensor", "fp8_block")
WINDOW, WINDOWS = 384, 3  # perplexity over 3 windows of 384 tokens
PROMPTS, PROMPT_TOKENS, CONTINUATION = 8, 32, 32
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def models():
    if not Path(BUNDLED_MODEL, "model.safetensors").exists():
        pytest.skip("the bundled model (bundled/tiny-v3/model.safetensors) has not been trained yet")
    return {q: LLM(BUNDLED_MODEL, quant=q, dtype="float32") for q in ("none", *FP8_MODES)}


@pytest.fixture(scope="module")
def heldout(models) -> list[int]:
    ids = models["none"].tokenizer.encode(HELDOUT.read_text())
    assert len(ids) >= WINDOWS * WINDOW, f"{HELDOUT} is too short for {WINDOWS} windows of {WINDOW} tokens"
    return ids


@pytest.fixture(scope="module")
def windows(models, heldout) -> list[list[int]]:
    size = min(WINDOW, models["none"].config.max_position_embeddings - 1)
    step = (len(heldout) - size) // (WINDOWS - 1)
    return [heldout[i * step : i * step + size] for i in range(WINDOWS)]


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    """exp(mean negative log-likelihood of every token after the first of each window)."""
    results = llm.generate(windows, max_tokens=1, prompt_logprobs=True)
    nll = [-lp for r in results for lp in r.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll))


@pytest.fixture(scope="module")
def full_precision_perplexity(models, windows) -> float:
    return perplexity(models["none"], windows)


@pytest.mark.parametrize("quant", FP8_MODES)
def test_fp8_heldout_perplexity_is_within_5_percent_of_full_precision(quant, models, windows, full_precision_perplexity):
    ppl = perplexity(models[quant], windows)
    ratio = ppl / full_precision_perplexity
    print(f"\nheld-out perplexity: none {full_precision_perplexity:.3f}, {quant} {ppl:.3f} ({ratio - 1:+.2%})")
    assert abs(ratio - 1) <= TOLERANCE


def test_greedy_text_agreement_with_full_precision_is_reported(models, heldout):
    step = (len(heldout) - PROMPT_TOKENS) // (PROMPTS - 1)
    prompts = [heldout[i * step : i * step + PROMPT_TOKENS] for i in range(PROMPTS)]
    reference = models["none"].generate(prompts, max_tokens=CONTINUATION)
    lines = [f"\ngreedy agreement with quant=none on {PROMPTS} held-out prompts ({CONTINUATION} tokens each):"]
    for quant in FP8_MODES:
        ours = models[quant].generate(prompts, max_tokens=CONTINUATION)
        assert all(r.token_ids for r in ours)
        same_text = sum(a.text == b.text for a, b in zip(ours, reference)) / PROMPTS
        prefix = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), min(len(a.token_ids), len(b.token_ids)))
                  for a, b in zip(ours, reference)]
        lines.append(f"  {quant:>15}: identical continuations {same_text:.0%}, "
                     f"mean common prefix {sum(prefix) / PROMPTS:.1f} of {CONTINUATION} tokens")
    print("\n".join(lines))
