"""`preload bench decode` end to end on the CPU, small: plain decoding and speculative
decoding drafted by the bundled draft model (bundled/tiny-v3-draft, trained with the
bundled model's tokenizer by scripts/train_tiny.py --draft-of), acceptance counted."""

from __future__ import annotations

from pathlib import Path

from preload.bench.decode import expected_tokens, format_table, run_decode
from preload.options import BUNDLED_MODEL

DRAFT = Path(BUNDLED_MODEL).parent / "tiny-v3-draft"


def test_decode_with_a_draft_model_counts_what_it_drafts_and_what_is_accepted():
    result = run_decode(Path(BUNDLED_MODEL), "cpu", ["none"], [(2, 16)], 8, False, lambda msg: None,
                        speculative=(0, 2), draft_model=DRAFT)
    plain, drafted = result["runs"]
    assert plain["speculative_tokens"] == 0 and plain["acceptance_rate"] is None
    assert drafted["speculative_tokens"] == 2 and 0 <= drafted["acceptance_rate"] <= 1
    assert all(r["output_tok_s"] > 0 for r in result["runs"]) and result["drafter"] == str(DRAFT)
    assert f"drafts by {DRAFT}" in format_table(result)
    # against the plain run: the step's time ratio, the speedup measured and those it allows
    assert drafted["step_ratio"] == drafted["ms_per_step"] / plain["ms_per_step"]
    assert drafted["speedup"] == drafted["output_tok_s"] / plain["output_tok_s"]
    at = drafted["speedup_at"]
    assert list(at) == ["0.5", "0.7", "0.9"] and at["0.5"] < at["0.7"] < at["0.9"]
    assert at["0.7"] == expected_tokens(2, 0.7) / drafted["step_ratio"]
    assert "step_ratio" not in plain and f"{drafted['speedup']:.2f}" in format_table(result)
    assert "step_floor" not in plain and drafted["step_floor"] > 1 and "floor x" in format_table(result)


def test_the_step_floor_counts_the_verify_rows_and_the_drafts_bytes():
    import torch

    from preload.bench.checkpoint import SHAPES
    from preload.bench.decode import draft_step_bytes, step_bytes, step_floor
    from preload.checkpoint.config import ModelConfig

    cfg = ModelConfig.from_dict(SHAPES["v3-slice"](1))
    bf16 = torch.bfloat16
    assert step_floor(cfg, "none", bf16, 1, 96, 0) == 1
    floors = [step_floor(cfg, "none", bf16, 1, 96, k) for k in (1, 2, 3)]
    assert floors == sorted(floors) and floors[0] > 1.8  # (the issue asked 1.15: more than the bytes allow)
    draft = draft_step_bytes(cfg, "none", bf16, 1, 96)
    head = 2 * cfg.vocab_size * cfg.hidden_size
    assert head < draft < step_bytes(cfg, "none", bf16, 1, 96)  # the MTP block and the head it shares
    small = ModelConfig.from_dir(DRAFT)
    assert draft_step_bytes(cfg, "none", bf16, 1, 96, small) == step_bytes(small, "none", bf16, 1, 96)


def test_expected_tokens_of_a_verify_step():
    assert expected_tokens(0, 0.7) == 1 and expected_tokens(2, 0.5) == 1.75
    assert abs(expected_tokens(3, 0.9) - (1 + 0.9 + 0.81 + 0.729)) < 1e-12


def test_every_timed_decode_step_carries_the_whole_batch():
    """Prompts prefilled in several steps of a small budget: no sequence decodes before
    the last prompt is in, so each of the output_len - 1 timed steps carries all of them
    (the byte count behind the HBM % assumes it)."""
    from preload.bench.decode import run_case
    from preload.options import EngineOptions
    from preload.worker.llm import LLM

    llm = LLM(BUNDLED_MODEL, device="cpu", engine=EngineOptions(max_num_batched_tokens=48))
    case = run_case(llm, 5, 40, 6, llm.config.vocab_size, seed=0)
    assert case["prefill_steps"] == -(-5 * 40 // 48)
    assert case["decode_steps"] == 5 and case["tokens_per_step"] == 5
    assert llm.engine.stats().kv_blocks_used == 0 and not llm.engine.has_work()
