"""DeepSeek's block-scaled FP8 format: quantize then dequantize stays within e4m3 precision."""

import torch

from preload.kernels.fp8 import FP8, dequantize_block, quantize_block


def test_block_roundtrip_within_e4m3_precision():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen)
    w[:128, :128] *= 100  # one block with a much larger range must not hurt the others
    q, scale_inv = quantize_block(w)
    assert q.dtype == FP8 and scale_inv.shape == (3, 2)
    back = dequantize_block(q, scale_inv, (128, 128), torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for values near their block's max.
    rel = (back - w).abs() / w.abs().clamp(min=1e-3)
    big = w.abs() > 0.1 * w.abs().amax()
    assert rel[big].max() <= 2**-4
    assert (back[128:, 128:] - w[128:, 128:]).abs().max() < 0.2
