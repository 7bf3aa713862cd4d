"""A checkpoint loaded in-process lies as the daemon's arena lays it out: every tensor as
stored in the files (or quantized as asked), a MoE layer's experts evenly spaced in one
buffer, so that stacking them for the GPU kernels copies nothing."""

import pytest
import torch
from safetensors import safe_open

from preload import BUNDLED_MODEL
from preload.checkpoint.config import ModelConfig
from preload.checkpoint.headers import safetensors_files
from preload.ipc.packed_weights import load_checkpoint, stored_specs_of
from preload.kernels.quant import Fp8Weight
from preload.kernels.fused_moe import stack_experts
from preload.worker.model.deepseek import MoE, Transformer

CFG = ModelConfig.from_dir(BUNDLED_MODEL)


def test_every_tensor_is_the_files_own():
    weights = load_checkpoint(BUNDLED_MODEL, CFG, torch.float32)
    read = 0
    for path in safetensors_files(BUNDLED_MODEL):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in weights:
                    assert torch.equal(weights[name], f.get_tensor(name).float()), name
                    read += 1
    assert read == len(weights) == len(stored_specs_of(CFG, BUNDLED_MODEL, "none", torch.float32))


@pytest.mark.parametrize("quant", ["none", "fp8_block"])
def test_a_layers_experts_stack_without_a_copy(quant):
    model = Transformer(CFG, load_checkpoint(BUNDLED_MODEL, CFG, torch.bfloat16, quant=quant))
    moe = next(layer.ffn for layer in model.layers if isinstance(layer.ffn, MoE))
    for part in ("gate", "up", "down"):
        experts = [getattr(e, part) for e in moe.experts]
        stacked = stack_experts(experts)
        if quant == "fp8_block":
            assert isinstance(stacked, Fp8Weight)
            pairs = [(stacked.q, [w.q for w in experts]), (stacked.scale_inv, [w.scale_inv for w in experts])]
        else:
            pairs = [(stacked, experts)]
        for whole, each in pairs:
            assert whole.data_ptr() == each[0].data_ptr(), part  # a view of the buffer, not a copy
            assert all(torch.equal(whole[e].view(torch.uint8), w.view(torch.uint8)) for e, w in enumerate(each))


def test_weights_share_one_buffer():
    weights = load_checkpoint(BUNDLED_MODEL, CFG, torch.float32)
    storages = {t.untyped_storage().data_ptr() for t in weights.values()}
    assert len(storages) == 1
