"""Weight quantization as the daemon stores it (linear.py reads it).

Modes: `none` (float weights), `fp8_per_tensor` (e4m3, one scale per matrix) and
`fp8_block` (e4m3 with a scale per 128x128 block, DeepSeek's layout). A quantized
matrix `name` is stored as e4m3 `name` plus float32 `name + "_scale_inv"`, with
W ~= Q * scale_inv; a per-tensor scale is a single block covering the matrix.
Embeddings, norms, the router and the output heads always stay in high precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from preload.kernels.fp8 import dequantize_block, quantize_block
from preload.kernels.precision import QUANT_BLOCK, SCALE_SUFFIX, is_quantizable, stored_dtype, stored_specs
from preload.options import QUANT_MODES

BLOCK = QUANT_BLOCK


def high_precision_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return getattr(torch, stored_dtype(name, str(dtype).removeprefix("torch.")))


def quantize_weight(
    name: str,
    tensor: torch.Tensor,
    scale_inv: torch.Tensor | None,
    source_block: tuple[int, int] | None,
    mode: str,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The stored form of one checkpoint tensor under `mode`: {name: weight} or
    {name: e4m3, name_scale_inv: scales}. `scale_inv` is given for native FP8 input,
    which stays as it is when the target is the same block layout."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quant mode {mode!r}; choose one of {', '.join(QUANT_MODES)}")
    if scale_inv is not None and mode == "fp8_block" and source_block == BLOCK:
        return {name: tensor, name + SCALE_SUFFIX: scale_inv.float()}
    if scale_inv is not None:
        tensor = dequantize_block(tensor, scale_inv, source_block, torch.float32)
    if mode == "none" or not is_quantizable(name):
        return {name: tensor.to(high_precision_dtype(name, dtype))}
    block = BLOCK if mode == "fp8_block" else tuple(tensor.shape)
    q, s = quantize_block(tensor, block)
    return {name: q, name + SCALE_SUFFIX: s}


@dataclass
class Fp8Weight:
    """An e4m3 matrix with its block scales (a [1, 1] scale is one per tensor)."""

    q: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.scale_inv.numel() == 1:
            return (self.q.float() * self.scale_inv.float().reshape(())).to(dtype)
        return dequantize_block(self.q, self.scale_inv, self.block, dtype)


Weight = torch.Tensor | Fp8Weight


def kernel_parts(w: Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(matrix, scales) as the Triton kernels take a weight: a bf16 matrix stands in for
    its own scales, which the kernel then never reads."""
    return (w.q, w.scale_inv) if isinstance(w, Fp8Weight) else (w, w)


def scale_block(w: Weight) -> tuple[int, int]:
    """The (rows, columns) of one scale block as the kernels step through them: a per-tensor
    scale (and bf16, which has none) is one block as large as any matrix."""
    if not isinstance(w, Fp8Weight) or w.scale_inv.shape[-2:] == (1, 1):
        return (1 << 30, 1 << 30)
    return w.block


def stored_layout(name: str, shape: tuple[int, ...], mode: str, dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple]]:
    """precision.stored_specs in torch dtypes."""
    specs = stored_specs(name, shape, mode, str(dtype).removeprefix("torch."))
    return {stored: (getattr(torch, dt), s) for stored, (dt, s) in specs.items()}
