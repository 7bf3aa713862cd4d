"""Small host values (indices, per-row parameters) sent to the device without waiting on it.

`torch.tensor(values, device="cuda")` copies from pageable memory, and PyTorch makes such
a copy synchronous: it waits for everything queued on the stream first. Where a step is
launched ahead of the last one's tokens (engine/pipeline.py), that wait undoes the overlap:
the host then idles until the GPU has finished both steps; within a step, the GPU idles
through every launch the host makes after it. From page-locked memory the copy
is queued like a kernel instead, and the page-locked block is not reused before it ran
(PyTorch's host allocator records the stream's use).
"""

from __future__ import annotations

import torch


def on_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` as a tensor on `device`, queued in the stream's order (no wait on a GPU)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def all_on_device(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Index lists as int64 tensors on `device`, in one copy (each a view of one tensor):
    every copy is a launch and a handful of host operations, and a step sends dozens."""
    flat = [v for values in lists for v in values]
    return list(on_device(flat, device, torch.long).split([len(values) for values in lists]))


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, queued in the stream's order (no wait on a GPU)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
