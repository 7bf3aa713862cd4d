"""The NaN/Inf check a load runs on each weight's raw bytes as it hashes them: one bad
value anywhere is found, in every float dtype a checkpoint holds; the largest finite values,
zeros of either sign and integers pass."""

from __future__ import annotations

import pytest
import torch

from preload.checkpoint.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_finite_check_finds_one_bad_value_anywhere(dtype, bad):
    def finite(t: torch.Tensor) -> bool:
        return all_finite(str(t.dtype).removeprefix("torch."), t.reshape(-1).view(torch.uint8).numpy())

    t = torch.randn(1000, 37).to(dtype)
    extremes = torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).max, torch.finfo(dtype).tiny, 0.0, -0.0], dtype=dtype)
    assert finite(t) and finite(extremes) and finite(torch.empty(0, dtype=dtype)) and finite(torch.arange(5))
    for at in (0, 12_345, t.numel() - 1):
        poisoned = t.clone()
        poisoned.view(-1)[at] = bad
        assert not finite(poisoned), (dtype, bad, at)


def test_the_finite_check_knows_e4m3_has_nan_but_no_infinity():
    values = torch.tensor([448.0, -448.0, 0.0, 1.5]).to(torch.float8_e4m3fn).view(torch.uint8)
    assert all_finite("float8_e4m3fn", values.numpy())
    for nan in (0x7F, 0xFF):  # every exponent and mantissa bit set, either sign
        poisoned = values.clone()
        poisoned[2] = nan
        assert not all_finite("float8_e4m3fn", poisoned.numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_finite_check_agrees_with_torch_on_every_bit_pattern(dtype):
    bits = 8 * dtype.itemsize
    patterns = torch.arange(1 << bits, dtype=torch.int32).to(torch.uint16 if bits == 16 else torch.uint8)
    values = patterns.view(dtype)
    name = str(dtype).removeprefix("torch.")
    bad = (~torch.isfinite(values.float())).nonzero().flatten().tolist()
    assert bad, dtype  # every float dtype here has NaN patterns
    for i in bad:  # each non-finite pattern alone, between two finite values
        alone = torch.cat([values[:1], values[i : i + 1], values[:1]]).view(torch.uint8)
        assert not all_finite(name, alone.numpy()), (dtype, hex(int(patterns[i])))
    finite = values[torch.isfinite(values.float())]
    assert all_finite(name, finite.view(torch.uint8).numpy())
