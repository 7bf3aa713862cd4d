"""kernels/launch.py on the GPU: a kept launcher launches what the JIT would, for tensors at
new addresses, at a new alignment, with new values, and under a CUDA graph's capture."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def products(batch: int, heads: int = 16, k: int = 512, n: int = 128, offset: int = 0, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch * heads * k + offset, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = x[offset:].view(batch, heads, k)
    w = torch.randn(heads, n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    return x, w, torch.einsum("bhk,hnk->bhn", x.float(), w.float())


def test_a_kept_launcher_computes_what_the_jit_does():
    from preload.kernels.head_matvec import _head_matvec, head_matvec
    from preload.kernels.launch import launcher

    kept = launcher(_head_matvec).kept
    kept.clear()
    for seed in range(4):  # the first through the JIT, the rest through the kept launcher: other addresses
        x, w, want = products(64, seed=seed)
        torch.testing.assert_close(head_matvec(x, w).float(), want, atol=0.5, rtol=2e-2)
    assert len(kept) == 1
    x, w, want = products(64, offset=1)  # 2 bytes in: another alignment, another kernel
    torch.testing.assert_close(head_matvec(x, w).float(), want, atol=0.5, rtol=2e-2)
    x, w, want = products(100)  # another batch: other values (and grid)
    torch.testing.assert_close(head_matvec(x, w).float(), want, atol=0.5, rtol=2e-2)
    assert len(kept) == 3


def test_a_kept_launcher_under_a_graphs_capture():
    from preload.kernels.head_matvec import head_matvec

    x, w, _ = products(32)
    head_matvec(x, w)  # kept before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = head_matvec(x, w)
    for seed in (5, 6):
        x.copy_(products(32, seed=seed)[0])
        graph.replay()
        torch.testing.assert_close(out.float(), torch.einsum("bhk,hnk->bhn", x.float(), w.float()), atol=0.5,
                                   rtol=2e-2)
