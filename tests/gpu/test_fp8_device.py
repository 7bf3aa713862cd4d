"""The block FP8 kernel the daemon quantizes with before torch is imported
(ipc/fp8_device.py) gives, byte for byte, what kernels/fp8.py's quantize_block gives on
the same GPU: e4m3 values and float32 scales, whole and partial blocks, any magnitude."""

from __future__ import annotations

import pytest
import torch

from preload.ipc import fp8_device
from preload.kernels.fp8 import quantize_block

pytestmark = pytest.mark.gpu


def weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-8, 3, cols)  # tiny to large columns
    w[: rows // 3, : cols // 5] = 0  # a block that may be all zeros: the 1e-12 floor
    w[-1, -1] = -w.abs().max() * 2  # a negative amax
    return w.to(torch.bfloat16).cuda()


@pytest.mark.parametrize("rows, cols", [(128, 128), (1, 7), (300, 520), (2048, 1408), (129, 4096)])
def test_the_kernel_quantizes_as_the_torch_reference(rows, cols):
    assert fp8_device.available(0)
    w = weights(rows, cols, rows * cols)
    want_q, want_s = quantize_block(w)
    q = torch.full((rows, cols), 0x7F, dtype=torch.uint8, device="cuda")  # (a NaN wherever nothing is written)
    s = torch.full(want_s.shape, float("nan"), device="cuda")
    kernel = fp8_device.Fp8BlockQuantizer(0)
    try:
        kernel.launch(torch.cuda.current_stream().cuda_stream, w.data_ptr(), q.data_ptr(), s.data_ptr(), rows, cols)
        torch.cuda.synchronize()
    finally:
        kernel.close()
    assert torch.equal(s, want_s), (s - want_s).abs().max()
    differ = (q != want_q.view(torch.uint8)).nonzero()
    assert len(differ) == 0, (len(differ), differ[:5].tolist(), q[tuple(differ[0])], want_q.view(torch.uint8)[tuple(differ[0])])
