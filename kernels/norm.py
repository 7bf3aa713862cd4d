"""RMSNorm: x / sqrt(mean(x^2) + eps) * weight, computed in float32. On a GPU each call
is one Triton launch (fused_norm.py); the torch code here is the reference and the CPU path."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        from preload.kernels.fused_norm import rms_norm as fused  # Triton: imported only where there is a GPU

        return fused(x, weight, eps)
    # Statistics in float32 whatever the activation dtype; the scale multiplies
    # after casting back, as DeepSeek's reference does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the residual stream's add and the next norm."""
    if x.is_cuda:
        from preload.kernels.fused_norm import add_rms_norm as fused

        return fused(x, residual, weight, eps)
    total = x + residual
    return rms_norm(total, weight, eps), total
