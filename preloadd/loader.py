"""Load a checkpoint into an arena: read each tensor once, hash it, quantize it, store it.

The arena is sized and laid out from the config before any weight is read, so a
checkpoint that cannot fit fails before memory is taken, and peak host memory stays
near the largest tensor rather than the model.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import psutil
import torch

from preload.checkpoint.config import ModelConfig
from preload.checkpoint.identity import AUX_FILES, checkpoint_record, fingerprint, tensor_digest
from preload.checkpoint.reader import CheckpointReader, SourceTensor, iter_checkpoint, wanted_shapes
from preload.ipc.arena import create_arena
from preload.ipc.layout import Layout, TensorEntry, pack
from preload.ipc.manifest import FILE_PREFIX, Manifest
from preload.kernels.quant import SCALE_SUFFIX, quantize_weight, stored_layout
from preload.preloadd.weights import Loaded, LoadError, Progress

LOADER_THREADS = 8


def plan(cfg: ModelConfig, model_dir: Path, quant: str, dtype: torch.dtype) -> tuple[list[TensorEntry], int, dict[str, bytes]]:
    """Arena entries for every stored tensor and for the tokenizer/config files."""
    with CheckpointReader(model_dir) as reader:
        shapes = wanted_shapes(cfg, reader)
    specs = [
        (name, stored_dtype, stored_shape)
        for source, shape in shapes.items()
        for name, (stored_dtype, stored_shape) in stored_layout(source, shape, quant, dtype).items()
    ]
    files = {name: (model_dir / name).read_bytes() for name in AUX_FILES if (model_dir / name).exists()}
    specs += [(FILE_PREFIX + name, torch.uint8, (len(data),)) for name, data in files.items()]
    entries, size = pack(specs)
    return entries, size, files


def finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in a weight (e4m3 has no Inf; its NaN is every exponent and mantissa bit set).
    One reduction: a NaN anywhere makes both the min and the max NaN, an infinity is one of
    them (20x faster than isfinite().all() on a CPU, which makes a tensor of booleans)."""
    if t.dtype == torch.float8_e4m3fn:
        return not bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_memory(size: int, device: torch.device) -> None:
    if device.type == "cpu":
        available = psutil.virtual_memory().available
        if size > available:
            raise LoadError(f"not enough host memory for the arena: need {size / 2**30:.2f} GiB, {available / 2**30:.2f} GiB available")


def load(
    model_dir: Path,
    quant: str,
    dtype: torch.dtype,
    device: torch.device,
    transport: str,
    progress: Progress,
    on_progress: Callable[[Progress], None] = lambda p: None,
) -> Loaded:
    progress.started = time.monotonic()  # the load alone: not the imports or the daemon's start before it
    with progress.timed("plan"):
        cfg = ModelConfig.from_dir(model_dir)
        entries, size, files = plan(cfg, model_dir, quant, dtype)
    by_name = {e.name: e for e in entries}
    progress.total_bytes, progress.tensors_total = size, len(entries)
    check_memory(size, device)
    arena = create_arena(transport, size, device)
    digests, sources, lock = {}, {}, threading.Lock()

    def store(src: SourceTensor) -> None:
        # Hashing, quantizing and writing release the GIL: several tensors go at once.
        entry = by_name[src.name]
        # Stored as read (host arena, neither quantized nor converted): written chunk by chunk in the pass.
        as_read = (arena.transport == "memfd" and src.scale_inv is None and src.name + SCALE_SUFFIX not in by_name
                   and entry.dtype == str(src.tensor.dtype).removeprefix("torch.") and entry.shape == tuple(src.tensor.shape))

        def visit(whole: torch.Tensor, first: int, chunk: torch.Tensor) -> None:
            if not finite(chunk):
                what = src.name if whole is not src.scale_inv else f"{src.name} scales"
                raise LoadError(f"{src.path}: tensor {what} holds NaN or Inf values; every request would fail")
            if as_read:
                arena.write_part(entry, first * chunk.element_size(), chunk)

        with progress.timed("hash"):  # one pass over the source: hashed, checked (and written as read) per chunk
            digest = tensor_digest(src.tensor, src.scale_inv, visit)
        if as_read:
            stored = [src.name]
        else:
            with progress.timed("upload"):
                scale = None if src.scale_inv is None else src.scale_inv.to(device)
                tensor = src.tensor.to(device)
            with progress.timed("quantize"):
                quantized = quantize_weight(src.name, tensor, scale, cfg.fp8_block, quant, dtype)
            with progress.timed("write"):
                for name, tensor in quantized.items():
                    arena.write(by_name[name], tensor)
            stored = list(quantized)
        with lock:
            digests[src.name], sources[src.name] = digest, src.path
            progress.done_bytes += sum(by_name[name].nbytes for name in stored)
            progress.tensors_done += len(stored)
            on_progress(progress)

    threads = min(LOADER_THREADS, os.cpu_count() or 1)
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="load") as pool:
            pending: set[Future] = set()
            sources_in_order = iter_checkpoint(model_dir, cfg)  # reads stay in order, one file region at a time
            while True:
                with progress.timed("read"):  # (the pages mapped in: reader.populate)
                    src = next(sources_in_order, None)
                if src is None:
                    break
                pending.add(pool.submit(store, src))
                if len(pending) >= 2 * threads:  # bounds host memory to a few tensors in flight
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in done:
                        f.result()
            for f in pending:
                f.result()
        with progress.timed("publish"):  # the config and tokenizer files in, the seals on
            for name, data in files.items():
                arena.write(by_name[FILE_PREFIX + name], torch.frombuffer(bytearray(data), dtype=torch.uint8))
                progress.tensors_done += 1
            arena.seal()
    except BaseException:
        arena.close()  # the last fd: the memory is gone with it
        raise
    progress.done_bytes = size
    progress.seconds = time.monotonic() - progress.started
    settings = {"quant": quant, "dtype": str(dtype).removeprefix("torch.")}
    record = checkpoint_record(model_dir, digests, sources)
    manifest = Manifest(
        model=str(model_dir),
        config=json.loads(files["config.json"]),
        **settings,
        device=str(device),
        arena=arena.info(),
        layout=Layout.of(entries),
        record=record,
        fingerprint=fingerprint(record.aux, digests, settings),
    )
    return Loaded(arena, manifest)
