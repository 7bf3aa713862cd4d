"""RMSNorm: x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32 whatever the activation dtype; the scale multiplies
    # after casting back, as DeepSeek's reference does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
