"""Every tensor a DeepSeek V2/V3 checkpoint holds for a config: its name and shape.

Names are those of the HF checkpoints (`model.layers.3.mlp.experts.7.up_proj.weight`),
so the loader can check a checkpoint before trusting it and the trainer can create one.
"""

from __future__ import annotations

from collections.abc import Container

from preload.checkpoint.config import ModelConfig

Shapes = dict[str, tuple[int, ...]]


def mtp_layer_index(cfg: ModelConfig) -> int:
    """V3 stores its multi-token-prediction module as one more layer after the last."""
    return cfg.num_layers


def _attention(cfg: ModelConfig, p: str) -> Shapes:
    d, h = cfg.hidden_size, cfg.num_heads
    shapes: Shapes = {}
    if cfg.q_lora_rank:
        shapes[f"{p}.q_a_proj.weight"] = (cfg.q_lora_rank, d)
        shapes[f"{p}.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes[f"{p}.q_b_proj.weight"] = (h * cfg.qk_head_dim, cfg.q_lora_rank)
    else:
        shapes[f"{p}.q_proj.weight"] = (h * cfg.qk_head_dim, d)
    shapes[f"{p}.kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)
    shapes[f"{p}.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    shapes[f"{p}.kv_b_proj.weight"] = (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    shapes[f"{p}.o_proj.weight"] = (d, h * cfg.v_head_dim)
    return shapes


def _mlp(p: str, d: int, inner: int) -> Shapes:
    return {f"{p}.gate_proj.weight": (inner, d), f"{p}.up_proj.weight": (inner, d), f"{p}.down_proj.weight": (d, inner)}


def _block(cfg: ModelConfig, layer: int) -> Shapes:
    p, d = f"model.layers.{layer}", cfg.hidden_size
    shapes = {f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight": (d,)}
    shapes |= _attention(cfg, f"{p}.self_attn")
    if not cfg.is_moe_layer(layer):
        return shapes | _mlp(f"{p}.mlp", d, cfg.intermediate_size)
    shapes[f"{p}.mlp.gate.weight"] = (cfg.n_routed_experts, d)
    if cfg.topk_method == "noaux_tc":
        shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
    for e in range(cfg.n_routed_experts):
        shapes |= _mlp(f"{p}.mlp.experts.{e}", d, cfg.moe_intermediate_size)
    if cfg.n_shared_experts:
        shapes |= _mlp(f"{p}.mlp.shared_experts", d, cfg.moe_intermediate_size * cfg.n_shared_experts)
    return shapes


def mtp_shapes(cfg: ModelConfig) -> Shapes:
    """The MTP module's own tensors. Its embedding and output head (`embed_tokens`,
    `shared_head.head`) are copies of the main model's and optional on disk."""
    m, d = mtp_layer_index(cfg), cfg.hidden_size
    p = f"model.layers.{m}"
    return {
        f"{p}.enorm.weight": (d,),
        f"{p}.hnorm.weight": (d,),
        f"{p}.eh_proj.weight": (d, 2 * d),
        f"{p}.shared_head.norm.weight": (d,),
    } | _block(cfg, m)


def checkpoint_shapes(cfg: ModelConfig, with_mtp: bool) -> Shapes:
    """Names and shapes of the main model (and the MTP module when asked)."""
    shapes: Shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for layer in range(cfg.num_layers):
        shapes |= _block(cfg, layer)
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if with_mtp:
        shapes |= mtp_shapes(cfg)
    return shapes


def declared_in_files(cfg: ModelConfig, stored: Container[str]) -> None:
    """ValueError naming the config's field if the files lack its last layer or expert:
    checked before the tensors are listed (a config of 10^9 layers would list them for
    minutes, holding gigabytes, before finding the first missing)."""
    last = f"model.layers.{cfg.num_layers - 1}.input_layernorm.weight"
    if last not in stored:
        raise ValueError(f"num_hidden_layers={cfg.num_layers}, but the files hold no {last}")
    moe = next((i for i in range(min(cfg.num_layers, 64)) if cfg.is_moe_layer(i)), None)
    if moe is not None:
        expert = f"model.layers.{moe}.mlp.experts.{cfg.n_routed_experts - 1}.down_proj.weight"
        if expert not in stored:
            raise ValueError(f"n_routed_experts={cfg.n_routed_experts}, but the files hold no {expert}")


def wanted_shapes(cfg: ModelConfig, stored: Container[str]) -> Shapes:
    """The tensors the model runs from: the main model, and the MTP module when the
    config declares one and the files hold it (`stored`: the names they hold;
    transformers saves no MTP module)."""
    declared_in_files(cfg, stored)
    mtp = mtp_shapes(cfg) if cfg.num_mtp_layers else {}
    with_mtp = bool(mtp) and all(name in stored for name in mtp)
    return checkpoint_shapes(cfg, with_mtp=with_mtp)
