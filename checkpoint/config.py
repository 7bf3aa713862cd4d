"""The model configuration: one dataclass read from an HF `config.json` of a DeepSeek V2 or V3 checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preload.options import DTYPES

ARCHITECTURES = {"DeepseekV2ForCausalLM": "v2", "DeepseekV3ForCausalLM": "v3"}


class ConfigError(ValueError):
    """The checkpoint's config.json is missing, malformed or describes a model we do not run."""


# The config's sizes, each an integer of at least this (0: may be absent); their names in
# config.json where ours differ.
SIZES = {"vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "num_layers": 1, "num_heads": 1, "kv_lora_rank": 1,
         "qk_nope_head_dim": 1, "qk_rope_head_dim": 2, "v_head_dim": 1, "q_lora_rank": 1, "moe_intermediate_size": 0,
         "n_routed_experts": 0, "n_shared_experts": 0, "num_experts_per_tok": 0, "first_k_dense_replace": 0,
         "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "max_position_embeddings": 1, "num_mtp_layers": 0}
JSON_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
              "num_mtp_layers": "num_nextn_predict_layers"}

@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; `factor` > 1 with `kind == "yarn"` stretches the context."""

    theta: float = 10000.0
    kind: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    interleaved: bool = True  # DeepSeek rotates adjacent pairs (x0, x1), (x2, x3), ...


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "v2" or "v3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    scoring_func: str = "softmax"  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    fp8_block: tuple[int, int] | None = None  # native FP8 checkpoint: e4m3 weights with per-block scales

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{file}: not found (is {path} a checkpoint directory?)") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{file}: cannot read: {e}") from None
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        """ConfigError naming the field if `raw` is not a config this model runs (a size
        that is not a positive integer included; that the files hold what the sizes say is
        checked where they are read: shapes.declared_in_files)."""
        archs = raw.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            supported = ", ".join(ARCHITECTURES)
            raise ConfigError(f"{source}: unsupported architecture {archs!r}; supported: {supported}")
        try:
            return cls._parse(raw, arch)
        except KeyError as e:
            raise ConfigError(f"{source}: missing field {e.args[0]!r}") from None
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def _parse(cls, raw: dict[str, Any], arch: str) -> ModelConfig:
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        n_experts = raw.get("n_routed_experts") or 0
        cfg = cls(
            arch=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"],
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            q_lora_rank=raw.get("q_lora_rank"),
            moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
            n_routed_experts=n_experts,
            n_shared_experts=raw.get("n_shared_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
            first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
            moe_layer_freq=raw.get("moe_layer_freq") or 1,
            scoring_func=raw.get("scoring_func") or ("sigmoid" if arch == "v3" else "softmax"),
            topk_method=raw.get("topk_method") or ("noaux_tc" if arch == "v3" else "greedy"),
            n_group=raw.get("n_group") or 1,
            topk_group=raw.get("topk_group") or 1,
            norm_topk_prob=bool(raw.get("norm_topk_prob", arch == "v3")),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope=_parse_rope(raw, arch),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            num_mtp_layers=(raw.get("num_nextn_predict_layers") or 0) if arch == "v3" else 0,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or "bfloat16",
            fp8_block=_parse_fp8(raw.get("quantization_config")),
        )
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        for name, least in SIZES.items():  # (before any arithmetic: "abc" or 1.5 layers say so)
            value = getattr(self, name)
            if name == "q_lora_rank" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{JSON_NAMES.get(name, name)}={value!r}: an integer >= {least}")
        if self.n_routed_experts:
            if self.num_experts_per_tok < 1 or self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, n_routed_experts]")
            if self.n_routed_experts % self.n_group:
                raise ConfigError(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
            if self.topk_group > self.n_group:
                raise ConfigError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if (self.scoring_func, self.topk_method) not in {
            ("softmax", "greedy"),
            ("softmax", "group_limited_greedy"),
            ("sigmoid", "noaux_tc"),
        }:
            raise ConfigError(f"unsupported routing: scoring_func={self.scoring_func!r} topk_method={self.topk_method!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")


def _parse_rope(raw: dict[str, Any], arch: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); original DeepSeek
    # checkpoints write `rope_theta` beside a `rope_scaling` dict.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(f"unsupported rope type {kind!r}; supported: default, yarn")
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    # V2 always rotates interleaved pairs; V3 exposes the choice (real checkpoints interleave).
    interleaved = arch == "v2" or bool(raw.get("rope_interleave", True))
    if kind == "default":
        return RopeConfig(theta=theta, interleaved=interleaved)
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=float(params["factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 4096)
        ),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 1.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        interleaved=interleaved,
    )


def _parse_fp8(qc: dict[str, Any] | None) -> tuple[int, int] | None:
    if not qc:
        return None
    if qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"unsupported quantization_config {qc!r}; supported: DeepSeek fp8 e4m3 block scales")
    block = qc.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def weights_dtype(dtype: str | None, device_type: str, cfg: ModelConfig) -> str:
    """The dtype name the weights are held in: an explicit one wins; otherwise bfloat16 on
    GPUs and the checkpoint's own dtype on CPU."""
    name = dtype or ("bfloat16" if device_type == "cuda" else cfg.torch_dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} not supported; choose one of {', '.join(DTYPES)}")
    return name
