"""Tensor and expert parallelism (worker/model/parallel.py, issue 38): the bundled model
computed by a group of 2 processes over gloo, each holding its share of the weights,
gives what one process gives: the prompts' log-probs within float32's rounding, and the
same greedy tokens. And the cut itself: which tensors are cut where, views not copies,
the experts of other ranks left out, refusals where a group cannot divide a dimension."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from preload import BUNDLED_MODEL, LLM
from preload.checkpoint.config import ModelConfig
from preload.ipc.packed_weights import load_checkpoint
from preload.worker.model.parallel import Ranks, rank_config, shard

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 2, 41], [17] * 20]
TOKENS = 12

RANK = """
import json, sys
import torch
import torch.distributed as dist
from preload import BUNDLED_MODEL, LLM
from preload.worker.model.parallel import Ranks

rank, size, experts, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "ep", sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
llm = LLM(BUNDLED_MODEL, dtype="float32", ranks=Ranks(rank, size, experts))
out = llm.generate(json.loads(sys.argv[5]), max_tokens=int(sys.argv[6]), ignore_eos=True, prompt_logprobs=True)
print(json.dumps([{"tokens": r.token_ids, "prompt_logprobs": r.prompt_logprobs[1:]} for r in out]))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def alone():
    out = LLM(BUNDLED_MODEL, dtype="float32").generate(PROMPTS, max_tokens=TOKENS, ignore_eos=True, prompt_logprobs=True)
    return [{"tokens": r.token_ids, "prompt_logprobs": r.prompt_logprobs[1:]} for r in out]


def group(size: int, experts: str, tmp_path) -> list[list[dict]]:
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(size), experts, init, json.dumps(PROMPTS),
                               str(TOKENS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(size)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.parametrize("experts", ["tp", "ep"], ids=["tensor-parallel", "expert-parallel"])
def test_two_ranks_give_what_one_gives(alone, experts, tmp_path):
    ranks = group(2, experts, tmp_path)
    for got in ranks:  # (every rank holds the whole result: each samples the same tokens)
        for g, want in zip(got, alone):
            assert g["tokens"] == want["tokens"]
            assert torch.allclose(torch.tensor(g["prompt_logprobs"]), torch.tensor(want["prompt_logprobs"]), atol=1e-5)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_dir(BUNDLED_MODEL)
    return cfg, load_checkpoint(BUNDLED_MODEL, cfg, torch.float32, torch.device("cpu"), "none")


def test_the_cut_views_each_ranks_share(model):
    cfg, w = model
    q, o, kv_b = "model.layers.1.self_attn.q_b_proj.weight", "model.layers.1.self_attn.o_proj.weight", \
        "model.layers.1.self_attn.kv_b_proj.weight"
    gate, down = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"
    shared = "model.layers.1.mlp.shared_experts.up_proj.weight"
    expert, norm = "model.layers.1.mlp.experts.6.gate_proj.weight", "model.layers.1.input_layernorm.weight"
    parts = [shard(cfg, w, Ranks(r, 2)) for r in range(2)]
    assert torch.equal(torch.cat([p[q] for p in parts]), w[q]) and parts[1][q].shape[0] == 2 * cfg.qk_head_dim
    assert torch.equal(torch.cat([p[kv_b] for p in parts]), w[kv_b])
    assert torch.equal(torch.cat([p[o] for p in parts], dim=1), w[o])
    assert torch.equal(torch.cat([p[gate] for p in parts]), w[gate])
    assert torch.equal(torch.cat([p[down] for p in parts], dim=1), w[down])
    assert torch.equal(torch.cat([p[shared] for p in parts]), w[shared])
    assert torch.equal(torch.cat([p[expert] for p in parts]), w[expert])
    assert all(p[norm] is w[norm] for p in parts)
    assert parts[1][q].untyped_storage().data_ptr() == w[q].untyped_storage().data_ptr()  # (a view)
    assert rank_config(cfg, Ranks(1, 2)).num_heads == cfg.num_heads // 2

    by_expert = [shard(cfg, w, Ranks(r, 2, expert_parallel=True)) for r in range(2)]
    assert expert not in by_expert[0] and by_expert[1][expert] is w[expert]  # (experts 4-7 are rank 1's)
    assert torch.equal(torch.cat([p[shared] for p in by_expert]), w[shared])  # (the shared experts are cut)


def test_a_group_that_cannot_divide_a_dimension_is_refused(model):
    cfg, w = model
    with pytest.raises(ValueError, match="attention heads: 4 cannot be split between 3 ranks"):
        rank_config(cfg, Ranks(0, 3))
