"""The linear layer over a stored weight: a float matrix, or e4m3 with its block scales.

On a GPU an fp8 matrix is read by a Triton kernel that dequantizes in registers
(fp8_linear.py); elsewhere the reference dequantizes the matrix, then multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from preload.kernels.fp8 import FP8
from preload.kernels.quant import SCALE_SUFFIX, Fp8Weight, Weight


def linear_weight(weights, name: str, block: tuple[int, int]) -> Weight:
    """The matrix `name` from a weights mapping, wrapped with its scales when quantized."""
    w = weights[name]
    if w.dtype == FP8:
        return Fp8Weight(w, weights[name + SCALE_SUFFIX], block)
    return w


def dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, Fp8Weight) else w


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x @ W^T. FP8 weights: on a GPU a Triton kernel reads e4m3 and its scales and
    dequantizes in registers (fp8_linear.py); the reference, elsewhere, dequantizes
    the matrix first."""
    if isinstance(w, Fp8Weight) and x.is_cuda:
        from preload.kernels.fp8_linear import fp8_linear  # Triton: imported only where there is a GPU

        return fp8_linear(x, w)
    return F.linear(x, dense(w, x.dtype))
