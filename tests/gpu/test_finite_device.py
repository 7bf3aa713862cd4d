"""The NaN/Inf check on the GPU (ipc/finite_device.py) finds what torch's isfinite finds:
every bit pattern of the 1- and 2-byte floats and a sample of float32's, alone among
finite values, anywhere in a tensor of any size; a device word keeps the first tag it is
given. A load into GPU memory that checks there names the bad tensor, as the host's
check does, and leaves nothing open."""

from __future__ import annotations

import os

import pytest
import torch
from checkpoints import with_a_bad_last_value

from preload.ipc import finite_device
from preload.preloadd import copy_loader
from preload.preloadd.copy_loader import copy_plan, load_copied
from preload.preloadd.weights import LoadError, Progress

pytestmark = pytest.mark.gpu

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float8_e4m3fn: torch.int8,
        torch.float8_e5m2: torch.int8, torch.float32: torch.int32}


def patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 1- or 2-byte float; float32: a million random ones and the
    edges (largest finite, the infinities, NaNs), as integers."""
    bits = BITS[dtype]
    if dtype != torch.float32:
        info = torch.iinfo(bits)
        return torch.arange(info.min, info.max + 1, dtype=torch.int64).to(bits)
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF], dtype=torch.int64)
    sample = torch.randint(-(2**31), 2**31, (1 << 20,), generator=gen, dtype=torch.int64)
    return torch.cat([edges, edges | -(2**31), sample]).to(torch.int32)  # (| the sign bit: the negative edges)


def launch(check, data: torch.Tensor, word: torch.Tensor, at: int, tag: int, dtype: torch.dtype) -> None:
    check.launch(torch.cuda.current_stream().cuda_stream, data.data_ptr(), data.numel() * data.element_size(),
                 str(dtype).removeprefix("torch."), word.data_ptr() + 4 * at, tag)


@pytest.mark.parametrize("dtype", list(BITS), ids=str)
def test_every_bad_pattern_is_found_alone_among_finite_values(dtype):
    assert finite_device.available(0)
    bits = patterns(dtype)
    bad = ~torch.isfinite(bits.view(dtype).float())
    good, wrong = bits[~bad].cuda(), bits[bad].cuda()
    assert len(wrong) > 0 and len(good) > 0
    width = 999  # (values a row: not a multiple of a block, a warp or a word)
    gen = torch.Generator().manual_seed(len(wrong))
    rows = good[torch.randint(0, len(good), (len(wrong), width), generator=gen).cuda()]
    rows[torch.arange(len(wrong), device="cuda"), torch.randint(0, width, (len(wrong),), generator=gen).cuda()] = wrong
    words = torch.zeros(1 + len(wrong), dtype=torch.int32, device="cuda")
    check = finite_device.FiniteCheck(0)
    try:
        launch(check, good.view(dtype), words, 0, 1, dtype)  # every finite pattern at once
        for i in range(len(wrong)):
            launch(check, rows[i].view(dtype), words, 1 + i, 2 + i, dtype)
        torch.cuda.synchronize()
    finally:
        check.close()
    assert words[0].item() == 0, "a finite pattern taken for NaN or Inf"
    missed = (words[1:].cpu() != torch.arange(2, 2 + len(wrong), dtype=torch.int32)).nonzero().flatten()
    assert len(missed) == 0, [hex(int(wrong[i]) & 0xFFFFFFFF) for i in missed[:8]]


def test_a_word_keeps_the_first_tag_and_large_tensors_are_read_whole():
    check = finite_device.FiniteCheck(0)
    words = torch.zeros(4, dtype=torch.int32, device="cuda")
    big = torch.zeros(3 << 26, dtype=torch.bfloat16, device="cuda")  # (384 MiB: many times the grid's threads)
    first, last = big.clone(), big.clone()
    first[0], last[-1] = float("nan"), float("-inf")
    try:
        for data, at, tag in [(big, 0, 9), (last, 0, 5), (first, 0, 7), (big, 1, 3), (first, 2, 4), (last, 3, 6)]:
            launch(check, data, words, at, tag, torch.bfloat16)
        torch.cuda.synchronize()
    finally:
        check.close()
    assert words.tolist() == [5, 0, 4, 6]


@pytest.mark.parametrize("quant, which", [("none", "largest"), ("none", "router"), ("fp8_block", "quantized")])
def test_a_load_into_gpu_memory_names_the_bad_tensor_found_there(model_dir, tmp_path, monkeypatch, quant, which):
    plan = copy_plan(model_dir, quant, "bfloat16", "cuda-vmm", "cuda:0")
    assert plan is not None and plan.checked_on_device
    name = {"largest": None, "router": next((n for n in plan.stored if n.endswith("mlp.gate.weight")), "no router"),
            "quantized": next(iter(plan.quantized), "none quantized")}[which]
    model, name = with_a_bad_last_value(model_dir, tmp_path / "model", float("nan"), name)

    def host_check(dtype, data):
        raise AssertionError("checked on the host too")

    monkeypatch.setattr(copy_loader, "all_finite", host_check)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LoadError, match=f"tensor {name} holds NaN or Inf"):
        load_copied(model, quant, "bfloat16", "cuda:0", "cuda-vmm", Progress())
    assert len(os.listdir("/proc/self/fd")) == fds  # the arena's fd and the files' are closed
    loaded = load_copied(model_dir, quant, "bfloat16", "cuda:0", "cuda-vmm", Progress())  # (the good one loads)
    assert loaded is not None
    loaded.arena.close()
