"""The fused RMSNorm (Triton) gives `norm.rms_norm`'s result, to within two units in the
last place of bf16 activations (the float32 statistic is summed in another order and,
on the GPU, its inverse square root is approximate: a normalized value may round the
other way, and then its product with the weight), and `add_rms_norm` also gives the
residual sum, exactly as torch rounds `x + residual`. Without a GPU it runs in Triton's
interpreter (tests/conftest.py); `-m gpu` adds the real models' widths."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE  # noqa: E402

from preload.kernels.fused_norm import add_rms_norm, rms_norm  # noqa: E402
from preload.kernels.norm import rms_norm as reference  # noqa: E402

EPS = 1e-6


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, act: torch.dtype) -> None:
    """bf16 activations: two units in the last place (the normalized value's rounding, then
    the weight's product's). float32: a relative 1e-5, what summing the statistic of a
    few thousand values in another order can move it."""
    assert got.dtype == want.dtype and got.shape == want.shape and not got.isnan().any()
    rel = 1e-5 if act == torch.float32 else 2 * torch.finfo(act).eps  # eps: at least one unit in the last place
    excess = (got.float() - want.float()).abs() - rel * want.float().abs()
    assert (excess <= 1e-30).all(), excess.max()


def rows(shape, dtype, seed, spare: int = 0) -> torch.Tensor:
    """Random rows [..., D]; with `spare`, a view into rows `spare` wider whose other
    columns are NaN (as the split halves of a projection's output lie), so that reading
    past D shows."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.full((*shape[:-1], shape[-1] + spare), float("nan"))
    wide[..., : shape[-1]] = torch.randn(*shape, generator=gen) * 3
    return wide.to(dtype).to(DEVICE)[..., : shape[-1]]


def norm_weight(d: int, dtype, seed: int = 9) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape, spare", [((1, 512), 64), ((37, 700), 0), ((2, 5, 96), 32)])
def test_rms_norm_equals_the_reference(shape, spare, dtype):
    x = rows(shape, dtype, 0, spare)
    w = norm_weight(shape[-1], dtype)
    assert_within_ulps(rms_norm(x, w, EPS), reference(x, w, EPS), dtype)


def test_a_float32_weight_promotes_the_output_as_torch_does():
    x = rows((3, 256), torch.bfloat16, 1)
    w = norm_weight(256, torch.float32)
    got = rms_norm(x, w, EPS)
    assert got.dtype == torch.float32
    assert_within_ulps(got, reference(x, w, EPS), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_add_rms_norm_gives_the_norm_of_the_sum_and_the_sum(tokens, dtype):
    x, residual = rows((tokens, 320), dtype, 2, spare=16), rows((tokens, 320), dtype, 3)
    w = norm_weight(320, dtype)
    normed, total = add_rms_norm(x, residual, w, EPS)
    assert torch.equal(total, x + residual), "rounded as torch rounds the sum"
    assert total.is_contiguous() and normed.is_contiguous()
    assert_within_ulps(normed, reference(x + residual, w, EPS), dtype)


def test_a_sum_of_mixed_dtypes_is_promoted_as_torch_does():
    x, residual = rows((4, 128), torch.bfloat16, 4), rows((4, 128), torch.float32, 5)
    w = norm_weight(128, torch.bfloat16)
    normed, total = add_rms_norm(x, residual, w, EPS)
    assert total.dtype == torch.float32 and torch.equal(total, x + residual)
    assert_within_ulps(normed, reference(x + residual, w, EPS), torch.float32)


def test_mismatched_shapes_are_refused():
    x = rows((2, 64), torch.float32, 6)
    with pytest.raises(ValueError):
        rms_norm(x, norm_weight(32, torch.float32), EPS)
    with pytest.raises(ValueError):
        add_rms_norm(x, rows((1, 64), torch.float32, 7), norm_weight(64, torch.float32), EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 256, 512])
@pytest.mark.parametrize("d", [512, 1536, 2048, 7168])  # kv_lora_rank, q_lora_rank, hidden sizes
def test_real_widths_on_the_gpu(d, tokens):
    x, residual = rows((tokens, d), torch.bfloat16, 8), rows((tokens, d), torch.bfloat16, 9)
    w = norm_weight(d, torch.bfloat16)
    assert_within_ulps(rms_norm(x, w, EPS), reference(x, w, EPS), torch.bfloat16)
    normed, total = add_rms_norm(x, residual, w, EPS)
    assert torch.equal(total, x + residual)
    assert_within_ulps(normed, reference(x + residual, w, EPS), torch.bfloat16)
