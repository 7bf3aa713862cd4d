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


def test_block_quantization_is_the_plain_formula_bit_for_bit():
    """quantize_block scales its own float32 copy in place and takes |w|'s block max as
    max(max, -min): the same bits as the formula written plainly, the input untouched."""
    gen = torch.Generator().manual_seed(1)
    for shape, dtype in (((256, 384), torch.bfloat16), ((129, 257), torch.float32), ((5, 3), torch.float32)):
        w = torch.randn(shape, generator=gen).to(dtype)
        before = w.clone()
        q, scale_inv = quantize_block(w)
        n, k = shape
        wf = torch.nn.functional.pad(w.float(), (0, -k % 128, 0, -n % 128))
        blocks = wf.view(wf.shape[0] // 128, 128, wf.shape[1] // 128, 128)
        plain_scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(FP8).max
        plain_q = (blocks / plain_scale[:, None, :, None]).clamp(-448, 448).to(FP8).view(wf.shape)[:n, :k]
        assert torch.equal(scale_inv, plain_scale) and torch.equal(q.view(torch.uint8), plain_q.view(torch.uint8))
        assert torch.equal(w, before)
