"""Load a checkpoint into an arena: read each tensor once, hash it, quantize it, store it.

The arena is sized and laid out from the config before any weight is read, so a
checkpoint that cannot fit fails before memory is taken, and peak host memory stays
near the largest tensor rather than the model. When there is no arithmetic to do (nothing
quantized or converted) the daemon loads with preloadd/copy_loader.py instead, without torch.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from preload.checkpoint.config import ModelConfig
from preload.checkpoint.finite import all_finite
from preload.checkpoint.identity import tensor_digest
from preload.checkpoint.reader import SourceTensor, iter_checkpoint
from preload.ipc.arena import create_arena
from preload.ipc.layout import TensorEntry, pack
from preload.ipc.packed_weights import stored_specs_of
from preload.kernels.quant import SCALE_SUFFIX, quantize_weight
from preload.preloadd.copy_loader import aux_files, aux_specs, check_memory, manifest_of, nonfinite, publish
from preload.preloadd.weights import Loaded, Progress

LOADER_THREADS = 8


def plan(cfg: ModelConfig, model_dir: Path, quant: str, dtype: torch.dtype) -> tuple[list[TensorEntry], int, dict[str, bytes]]:
    """Arena entries for every stored tensor and for the tokenizer/config files."""
    files = aux_files(model_dir)
    entries, size = pack(stored_specs_of(cfg, model_dir, quant, dtype) + aux_specs(files))
    return entries, size, files


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
    check_memory(size, str(device))
    arena = create_arena(transport, size, str(device))
    digests, sources, lock = {}, {}, threading.Lock()

    def store(src: SourceTensor) -> None:
        # Hashing, quantizing and writing release the GIL: several tensors go at once.
        entry = by_name[src.name]
        # Stored as read (host arena, neither quantized nor converted): written chunk by chunk in the pass.
        as_read = (arena.transport == "memfd" and src.scale_inv is None and src.name + SCALE_SUFFIX not in by_name
                   and entry.dtype == str(src.tensor.dtype).removeprefix("torch.") and entry.shape == tuple(src.tensor.shape))

        def visit(part: int, at: int, chunk: memoryview) -> None:
            progress.check()
            if not all_finite(str(parts[part].dtype).removeprefix("torch."), chunk):
                raise nonfinite(src.path, f"{src.name} scales" if part else src.name)
            if as_read:
                arena.write_part(entry, at, chunk)

        parts = [t for t in (src.tensor, src.scale_inv) if t is not None]

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
                progress.check()
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
        publish(arena, by_name, files, progress)
    except BaseException:
        arena.close()  # the last fd: the memory is gone with it
        raise
    progress.done_bytes = size
    progress.seconds = time.monotonic() - progress.started
    return Loaded(arena, manifest_of(model_dir, files, quant, str(dtype).removeprefix("torch."), str(device), arena,
                                     entries, digests, sources))
