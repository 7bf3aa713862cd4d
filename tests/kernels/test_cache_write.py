"""The cache write kernel (Triton) stores each new token's latents at its slot, through
the pools' addresses on the device, exactly as the torch path of `write_latents` does:
the same bf16 rows, the same e4m3 rows and scales; every other slot untouched."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE, with_ptrs  # noqa: E402

from preload.kernels.attention import Pools, write_latents  # noqa: E402
from preload.kernels.cache_write import write_latents_triton  # noqa: E402
from preload.kernels.fp8 import FP8  # noqa: E402
from preload.kernels.triton_dot import INTERPRETING  # noqa: E402


def empty_pools(slots: int, rank: int, rope: int, fp8: bool) -> Pools:
    store = FP8 if fp8 else torch.bfloat16
    pools = [torch.zeros(slots, w, device=DEVICE).to(store) for w in (rank, rope)]
    scales = [torch.full((slots, 1), -1.0, device=DEVICE) for _ in range(2)] if fp8 else [None, None]
    return with_ptrs(Pools(*pools, *scales))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rank, rope", [(64, 16), (48, 8)])  # widths that are not powers of two as well
def test_the_kernel_writes_what_torch_writes(fp8, rank, rope):
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(40, generator=gen)[:7].to(DEVICE)
    c_kv = (torch.randn(7, rank, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    k_pe = torch.randn(7, rope, generator=gen).to(torch.bfloat16).to(DEVICE)
    got, want = empty_pools(40, rank, rope, fp8), empty_pools(40, rank, rope, fp8)
    write_latents_triton(got, slots, c_kv, k_pe)
    write_latents(want._replace(ptrs=None), slots, c_kv, k_pe)  # no addresses: the torch path
    for g, w in zip(got[:4], want[:4]):
        if g is None:
            continue
        g, w = g.float(), w.float()
        if fp8 and INTERPRETING:
            # Triton's interpreter converts to e4m3 its own way: ties away from zero, and
            # a value just under a power of two, which rounds up to it, to half of it
            # (the mantissa carries, the exponent does not). The GPU converts as torch
            # does, and is held to equality. Only those two are let through here.
            off = g != w
            step = 2.0 ** (w[off].abs().log2().floor() - 3)  # e4m3: 3 mantissa bits
            rollover = (w[off].abs().log2() % 1 == 0) & (g[off] == w[off] / 2)
            assert (rollover | ((g[off] - w[off]).abs() <= step)).all()
            g = torch.where(off, w, g)
        assert torch.equal(g, w)
    untouched = torch.ones(40, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert (got.c_kv[untouched].float() == 0).all()
    if fp8:
        assert (got.c_scale[untouched] == -1).all() and (got.c_scale[slots] > 0).all()


def test_on_hopper_a_row_is_stored_in_vectors():
    """The pool's address comes from the table, so the kernel says it is 16-byte aligned:
    a bf16 row of 512 is then stored 8 bytes a thread, not 2 (compiled for sm_90 here)."""
    from hopper_compile import compile_for_hopper, count

    signature = {"ptrs_ptr": "*i64", "slots_ptr": "*i64", "c_ptr": "*bf16", "k_ptr": "*bf16", "stride_c": "i32",
                 "stride_k": "i32"}
    constexprs = dict(R=512, DR=64, BLOCK_R=512, BLOCK_DR=64, CACHE="tl.bfloat16", FP8=False, FP8_MAX=448.0)
    ptx = compile_for_hopper("preload.kernels.cache_write", "_write_latents", signature, constexprs)["ptx"]
    assert count(ptx, "st.global.v2.b32") + count(ptx, "st.global.v4.b32") >= 1
