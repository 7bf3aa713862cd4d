"""Synthetic random-weight checkpoints in HF layout, standing in for real ones of the same shapes.

No transformers needed: names and shapes come from `preload.checkpoint.shapes`, the same
table the loader checks a checkpoint against, so whatever this writes the daemon loads.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

# DeepSeek-V2-Lite's real tensor shapes (hidden 2048, 16 heads, kv_lora 512, no q_lora,
# expert width 1408, 2 shared experts, vocab 102400), cut to one dense and one MoE layer
# with 8 routed experts so that the whole checkpoint is about 1.2 GB in bf16: big enough
# for load figures to mean something on a CPU host, small enough to write in seconds.
V2_LITE_MINI = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# V2-Lite's long context as released: YaRN stretches 4k positions 40x.
V2_LITE_CONTEXT = {
    "max_position_embeddings": 163840,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _fill(shape: tuple[int, ...], name: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=gen.device)
    if len(shape) >= 2:
        return t.normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=gen)  # keeps activations O(1)
    if name.endswith("e_score_correction_bias"):
        return t.zero_()
    return t.uniform_(0.5, 1.5, generator=gen)  # norm weights


def word_level_tokenizer(vocab_size: int, bos: int | None, eos: int | None) -> tuple[str, dict]:
    """(tokenizer.json's text, tokenizer_config.json's dict) of a word-level tokenizer
    over "t0".."tN" covering the whole vocab: enough to load."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    config = {"bos_token": f"t{bos}" if bos is not None else None, "eos_token": f"t{eos}" if eos is not None else None,
              "add_bos_token": bos is not None}
    return tok.to_str(), config


def _write_tokenizer(out_dir: Path, vocab_size: int, bos: int | None, eos: int | None) -> None:
    text, config = word_level_tokenizer(vocab_size, bos, eos)
    (out_dir / "tokenizer.json").write_text(text)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def random_weights(config: dict, quant: str, dtype: torch.dtype, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights a checkpoint of `config` holds once loaded (quantized as `quant` asks),
    drawn as make_random_checkpoint draws them, straight into `device`'s memory: no files,
    so a benchmark of V2-Lite's shapes on a GPU starts in seconds. Each layer's experts are
    views of one tensor per matrix, one expert after the other, as the daemon's arena
    lays them out (so the kernels read them in place, as a worker does)."""
    from preload.checkpoint.config import ModelConfig
    from preload.checkpoint.shapes import checkpoint_shapes
    from preload.kernels.quant import quantize_weight

    cfg = ModelConfig.from_dict(config)
    gen = torch.Generator(device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    experts: dict[str, list[str]] = {}  # a layer's matrix of every expert, by the first expert's name
    for name, shape in checkpoint_shapes(cfg, with_mtp=False).items():
        weights |= quantize_weight(name, _fill(shape, name, dtype, gen), None, None, quant, dtype)
        if ".experts." in name:
            head, _, tail = name.partition(".experts.")
            experts.setdefault(f"{head}.experts.*.{tail.partition('.')[2]}", []).append(name)
    for names in experts.values():
        for stored in [n for n in weights if n.startswith(names[0])]:  # the matrix, and its scales if quantized
            suffix = stored.removeprefix(names[0])
            stacked = torch.stack([weights[n + suffix] for n in names])
            weights |= {n + suffix: stacked[e] for e, n in enumerate(names)}
    return weights


def make_random_checkpoint(
    out_dir: str | Path,
    config: dict,
    shard_bytes: int = 500 * 10**6,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    with_mtp: bool = False,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write a random-weight checkpoint for `config` (an HF config.json dict) in HF layout.

    `out_dir` gets config.json, safetensors shards of at most `shard_bytes` each (one
    tensor larger than that gets a shard of its own) named model-0000i-of-0000n.safetensors
    with a model.safetensors.index.json (a single model.safetensors when one shard holds
    it all), and a tokenizer: copied from `tokenizer_from` if given, else a word-level one
    of the config's vocab size. Weights are `dtype` (config.json's torch_dtype is set to
    match), matrices normal(0, 1/sqrt(fan_in)), norms uniform(0.5, 1.5), drawn from a
    generator seeded with `seed` (on the GPU when there is one), so the same arguments on
    the same kind of machine give the same bytes. Only one
    shard's tensors are in memory at a time. `with_mtp` adds a V3 config's MTP layer.
    Returns `out_dir`.
    """
    from safetensors.torch import save_file

    from preload.checkpoint.config import ModelConfig
    from preload.checkpoint.shapes import checkpoint_shapes

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(config) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    config.pop("dtype", None)
    cfg = ModelConfig.from_dict(config)
    shapes = checkpoint_shapes(cfg, with_mtp=with_mtp and cfg.num_mtp_layers > 0)

    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes

    for old in out_dir.glob("model*.safetensors*"):
        old.unlink()  # a previous, differently sharded run must not leave files behind
    # Drawn on the GPU when there is one (a 31 GB checkpoint in seconds, not minutes);
    # the bytes then differ from a CPU run with the same seed.
    gen = torch.Generator("cuda" if torch.cuda.is_available() else "cpu").manual_seed(seed)
    n = len(shards)
    weight_map, total = {}, 0
    for i, names in enumerate(shards, 1):
        file = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = {name: _fill(shapes[name], name, dtype, gen).cpu() for name in names}
        total += sum(t.nbytes for t in tensors.values())
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        del tensors
        weight_map |= dict.fromkeys(names, file)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))

    if tokenizer_from is not None:
        for name in _TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).exists():
                shutil.copy(Path(tokenizer_from) / name, out_dir / name)
    else:
        _write_tokenizer(out_dir, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids[0] if cfg.eos_token_ids else None)
    return out_dir


# DeepSeek-V3's real layer shapes (hidden 7168, 128 heads, q_lora 1536, 256 experts of
# width 2048, top-8 in 4 of 8 groups, vocab 129280), 1 dense layer and a few MoE ones.
V3_LAYER = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

# A small model of V3's vocabulary and settings (hidden 1024, 8 heads, 2 layers, 16
# experts of width 512; ~0.6 GB bf16, most of it the embedding and the head): a draft
# model for v3-slice (`preload bench decode --draft-model`).
V3_DRAFT = V3_LAYER | {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "moe_intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 384,
    "n_routed_experts": 16,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 0,
}

# The V2-Lite family's settings at toy sizes: what the benchmarks run on when the bundled
# model has not been trained into the package.
TINY = V2_LITE_MINI | {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

SHAPES = {
    "v2-lite": lambda moe_layers: V2_LITE_MINI | V2_LITE_CONTEXT | {"num_hidden_layers": 27, "n_routed_experts": 64},
    "v2-lite-mini": lambda moe_layers: V2_LITE_MINI,
    "v3-slice": lambda moe_layers: V3_LAYER | {"num_hidden_layers": 1 + moe_layers},
    "v3-draft": lambda moe_layers: V3_DRAFT,
}


def weight_bytes(model: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))


def small_model(work: Path) -> tuple[str, Path]:
    """(label, dir) of the bundled model, or (when it has not been trained into the
    package) of a tiny random checkpoint of the same family written under `work`."""
    from preload.options import BUNDLED_MODEL

    if (Path(BUNDLED_MODEL) / "model.safetensors").exists():
        return "bundled", Path(BUNDLED_MODEL)
    return "tiny-random", make_random_checkpoint(work / "tiny", TINY, seed=0)


def large_model(path: Path) -> tuple[str, Path]:
    """(label, dir) of a checkpoint of at least 1 GB: the one at `path`, or V2-Lite's
    real shapes cut to ~1.2 GB (V2_LITE_MINI), written there unless it is there already."""
    if not ((path / "config.json").exists() and weight_bytes(path) > 10**9):
        make_random_checkpoint(path, V2_LITE_MINI, seed=0)
    return path.name, path
