"""Rotary position embedding with DeepSeek's YaRN context extension.

Only the `qk_rope_head_dim` slice of each query and the shared `k_pe` are rotated;
MLA keeps the rest of the head position-free so that it can be absorbed.
"""

import math
from typing import Protocol

import torch


class RopeParams(Protocol):
    """What the rotary math reads of a model's rope settings (the checkpoint's
    RopeConfig has these fields); declared here so the kernels import nothing above them."""

    theta: float
    kind: str  # "default" or "yarn"
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(rope: RopeParams, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (dim/2 of them) and the factor that scales cos and sin."""
    extrapolation = 1.0 / rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.kind == "default":
        return extrapolation, 1.0
    interpolation = extrapolation / rope.factor

    # Dimensions that turn fewer than beta_slow times over the original context are
    # interpolated, those that turn more than beta_fast times are kept, with a
    # linear ramp in between.
    def correction_dim(rotations: float) -> float:
        base_len = rope.original_max_position_embeddings
        return dim * math.log(base_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = interpolation * ramp + extrapolation * (1 - ramp)
    scale = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return inv_freq, scale


def softmax_scale(rope: RopeParams, qk_head_dim: int) -> float:
    """1/sqrt(d), corrected for YaRN's temperature when the context is stretched."""
    scale = qk_head_dim**-0.5
    if rope.kind == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [..., dim/2] for integer positions of shape [...]."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device)
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate pairs of x [..., dim] by the angles in cos/sin [..., dim/2].

    Interleaved layouts pair (x0, x1), (x2, x3), ...; the other pairs x[i] with
    x[i + dim/2]. Either way the result is written with the pair halves split, a
    fixed permutation that queries and keys share, so their dot products match
    the reference layout exactly.
    """
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_qk(q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
            interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries q_pe [T, H, dr] and the shared key k_pe [T, dr] rotated to positions [T]: on a
    GPU in one Triton launch (fused_rope.py, cos and sin made in it), elsewhere as here."""
    if q_pe.is_cuda:
        from preload.kernels.fused_rope import fused_rope_qk  # Triton: imported only where there is a GPU

        return fused_rope_qk(q_pe, k_pe, positions, inv_freq, scale, interleaved)
    cos, sin = rope_cos_sin(positions, inv_freq, scale)
    return apply_rope(q_pe, cos[:, None], sin[:, None], interleaved), apply_rope(k_pe, cos, sin, interleaved)
