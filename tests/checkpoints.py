"""Tiny random DeepSeek checkpoints made with transformers, the oracle our model is checked against."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 97

# Shapes shared by every tiny config; the cases below vary what the architectures vary.
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    q_lora_rank=None,
)

YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=0.707,
    mscale_all_dim=0.707,
)

CASES = {
    "v2-greedy-tied": ("v2", dict(topk_method="greedy", tie_word_embeddings=True)),
    "v2-grouped-qlora-yarn": (
        "v2",
        dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=3,
             q_lora_rank=24, routed_scaling_factor=1.5, rope_parameters=YARN),
    ),
    "v2-dense-only": ("v2", dict(first_k_dense_replace=3, n_shared_experts=2)),
    "v3-qlora-yarn": (
        "v3",
        dict(q_lora_rank=24, n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5,
             rope_parameters=YARN),
    ),
    "v3-no-qlora-one-group": ("v3", dict(n_group=1, topk_group=1, norm_topk_prob=False)),
    "v3-rotate-half-2-shared": ("v3", dict(n_group=2, topk_group=1, n_shared_experts=2, rope_interleave=False,
                                           first_k_dense_replace=2, num_hidden_layers=4)),
}


def write_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer over tokens "t0".."tN", enough for LLM to load the directory."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def make_hf_model(arch: str, seed: int = 0, **overrides):
    """A transformers DeepSeek model with random weights large enough to matter."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    config_cls, model_cls = {
        "v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
        "v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(BASE | overrides))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.1, 0.1)
    return model


def save_hf_model(model, path: Path, dtype: torch.dtype = torch.float32) -> Path:
    model.to(dtype).save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return path


def with_a_bad_last_value(checkpoint: Path, to: Path, value: float, name: str | None = None) -> tuple[Path, str]:
    """A copy of a one-file `checkpoint` whose tensor `name` (by default its largest) ends
    in `value` (NaN, an infinity): the copy and that tensor's name."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, to)
    (path,) = to.glob("*.safetensors")
    tensors = load_file(path)
    name = name or max(tensors, key=lambda n: tensors[n].numel())
    tensors[name].view(-1)[-1] = value
    save_file(tensors, path)
    return to, name
