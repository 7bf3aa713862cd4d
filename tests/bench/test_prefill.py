"""`preload bench prefill` on the CPU, small: cases parse as written, a step is set up with
its contexts in the cache and runs the same work each time (the same greedy tokens, the
cache as it was), served or queued behind the step before, its floating-point work is
counted as the model does it, and the whole bench writes a table. The GPU's breakdown is
tested in tests/gpu/test_bench.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from preload.bench.prefill import Case, Step, format_table, run_prefill, step_flops
from preload.checkpoint.config import ModelConfig
from preload.options import BUNDLED_MODEL, EngineOptions


def test_a_case_is_written_tokens_x_seqs_cached_and_decode_rows():
    assert Case.parse("2048x8+64@1024") == Case(2048, 8, 0, 64, 1024)
    assert Case.parse("2048x1c30720") == Case(2048, 1, 30720)
    assert Case.parse("512x2c64+4@32").label == "512x2c64+4@32"
    assert Case.parse("2048x8").per_seq == 256 and Case.parse("64x2c32+4@32").cache_tokens(16) == 2 * 64 + 4 * 48
    for bad in ("2048", "2048x3", "8x16", "2048x8+64", "x8"):
        with pytest.raises(ValueError):
            Case.parse(bad)


def test_the_flop_count_is_the_models_products():
    cfg = ModelConfig.from_dir(BUNDLED_MODEL)
    flops = step_flops(cfg, Case(64, 2, 32, 0, 0))
    d, h = cfg.hidden_size, cfg.num_heads
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    pairs = 2 * (32 * 32 + 32 * 33 // 2)  # each of 32 new tokens sees the 32 cached and those before it
    assert flops["attention: prompt, flash"] == 2 * cfg.num_layers * pairs * h * (dn + dr + dv)
    assert flops["output head"] == 2 * 2 * d * cfg.vocab_size
    assert flops["attention: decode rows"] == 0
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert flops["routed experts: grouped GEMMs"] == 2 * 64 * moe * cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size
    assert step_flops(cfg, Case(64, 2, 32, 3, 100))["attention: decode rows"] > 0


def test_a_step_runs_the_same_work_every_time():
    from preload.worker.llm import LLM

    llm = LLM(BUNDLED_MODEL, device="cpu", engine=EngineOptions(enable_prefix_caching=False))
    step = Step(llm.engine, Case.parse("24x2c16+3@20"), llm.config.vocab_size, seed=1)
    assert [s.computed for s in step.decoding + step.prompts] == [0] * 5  # (set by each run)
    outputs = []
    for _ in range(3):
        step.run()
        outputs.append([s.output[-1] for s in step.decoding + step.prompts])
        assert [s.computed for s in step.decoding] == [21] * 3 and [s.computed for s in step.prompts] == [28, 28]
    assert outputs[0] == outputs[1] == outputs[2]
    # launched alone (queued behind the step before, as served): the same rows, the same log-probs each time
    first, again = step.launch(), step.launch()
    assert first.shape == (5, llm.config.vocab_size) and torch.equal(first, again)
    used = llm.engine.blocks.used
    step.release()
    assert used > 0 and llm.engine.blocks.used == 0


def test_the_bench_writes_a_row_per_case_and_a_whole_prompt(tmp_path):
    result = run_prefill(Path(BUNDLED_MODEL), None, "cpu", ["none"], [Case.parse("32x2"), Case.parse("16x1c8+2@8")],
                         [40], 16, 2, lambda msg: None)
    rows = {r["case"]: r for r in result["runs"]}
    assert set(rows) == {"32x2", "16x1c8+2@8"}
    assert all(r["ms"] > 0 and r["queued_ms"] > 0 and r["tflop"] > 0 for r in rows.values())
    (prompt,) = result["prompts"]
    assert prompt["prompt"] == 40 and prompt["steps"] == 3 and prompt["prompt_tok_s"] > 0
    assert "16x1c8+2@8" in format_table(result)
