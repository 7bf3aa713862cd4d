"""The fp8 linear layer (Triton) gives x @ W^T of the dequantized matrix, for block and
per-tensor scales, for a few rows (split-K, whatever the number of slices, launch after
launch: the arrival counters reset themselves) and for many (the grouped GEMM), with
edges that fill neither a tile nor a scale block; the fused gate/up/SiLU gives what
the three steps give."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from preload.kernels.fp8 import quantize_block  # noqa: E402
from preload.kernels.fp8_linear import GEMV_ROWS, ROW_DOT_ROWS, fp8_linear, split_k_gemv  # noqa: E402
from preload.kernels.moe import swiglu  # noqa: E402
from preload.kernels.quant import Fp8Weight  # noqa: E402
from preload.kernels.split_k import counters  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def weight(n: int, k: int, block: tuple[int, int] | None, seed: int = 2) -> Fp8Weight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[: min(n, 128), : min(k, 128)] *= 20  # one block far larger: its scale must stay its own
    q, scale = quantize_block(w, block or w.shape)
    return Fp8Weight(q.to(DEVICE), scale.to(DEVICE), block or w.shape)


def rows_of(shape: tuple[int, ...], k: int, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, k, generator=gen).to(torch.bfloat16).to(DEVICE)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("block", [(128, 128), None], ids=["fp8_block", "fp8_per_tensor"])
@pytest.mark.parametrize("rows", [1, 5, GEMV_ROWS, GEMV_ROWS + 1, 70])
def test_fp8_linear_equals_the_dequantized_matrix(block, rows):
    w = weight(200, 384, block)
    x = rows_of((2, rows), 384)
    want = x.float() @ w.dequantize(torch.float32).T
    got = fp8_linear(x, w)
    assert got.shape == (2, rows, 200) and got.dtype == x.dtype
    assert close(got, want), (got.float() - want).abs().max()


@pytest.mark.parametrize("rows", [ROW_DOT_ROWS, ROW_DOT_ROWS + 1], ids=["a program per row", "a tile of rows"])
@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_split_k_sums_every_slice_once(splits, rows):
    """K of 5 tiles, the last partial, cut into 1 to 5 slices: the same sums each time,
    launch after launch, with every counter back at zero."""
    w = weight(96, 4 * 128 + 40, (128, 128))
    x = rows_of((rows,), 4 * 128 + 40)
    want = x.float() @ w.dequantize(torch.float32).T
    for _ in range(3):
        got = split_k_gemv(x, w, splits=splits)
        assert got.shape == (rows, 96) and got.dtype == x.dtype
        assert close(got, want), (got.float() - want).abs().max()
    assert not counters(x.device).any()


@pytest.mark.parametrize("block", [(128, 128), None], ids=["fp8_block", "fp8_per_tensor"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("rows", [1, 4])
def test_fused_gate_up_equals_silu_gate_times_up(block, splits, rows):
    gate, up = weight(160, 384, block, seed=4), weight(160, 384, block, seed=5)
    x = rows_of((rows,), 384)
    g, u = (x.float() @ m.dequantize(torch.float32).T for m in (gate, up))
    want = torch.nn.functional.silu(g) * u
    got = split_k_gemv(x, gate, up, splits=splits)
    assert close(got, want), (got.float() - want).abs().max()


def test_swiglu_of_fp8_matrices_agrees_with_the_dequantized_ones():
    """(On a GPU through the fused gate/up launch; elsewhere the reference's three steps.)"""
    gate, up, down = (weight(n, k, (128, 128), seed=s) for n, k, s in ((160, 256, 6), (160, 256, 7), (256, 160, 8)))
    x = rows_of((2,), 256)
    dense = [m.dequantize(torch.float32) for m in (gate, up, down)]
    want = (torch.nn.functional.silu(x.float() @ dense[0].T) * (x.float() @ dense[1].T)) @ dense[2].T
    assert close(swiglu(x, gate, up, down), want)
