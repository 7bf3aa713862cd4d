"""Loading a checkpoint without torch: every tensor stored as the file holds it (a bfloat16
or float16 router weight widened to float32, bit for bit), or, for fp8_block into GPU
memory, each bf16 projection matrix quantized on the GPU as it arrives.

That is a `--quant none` load of a checkpoint already in the model's dtype (DeepSeek
V2-Lite's bf16 files on a GPU; a float32 checkpoint on the CPU) into a memfd or cuda-vmm
arena, and a `--quant fp8_block` load of bf16 files into a cuda-vmm arena on a GPU that
has e4m3 in hardware (ipc/fp8_device.py). The daemon then needs no torch to be ready: on
a GPU host `import torch` alone takes 4-6 s, longer than reading V2-Lite's 31 GB from the
page cache. The files are mapped, and a pool of threads takes each tensor a chunk at a
time, while the chunk is in the cache: hashed (BLAKE3), checked for NaN and Inf (numpy;
into GPU memory, on the GPU behind the copies: ipc/finite_device.py) and copied into the
arena (memfd: pwrite; cuda-vmm: through pinned buffers, ipc/staging.py; a matrix to
quantize goes to the thread's device scratch, and the kernel writes the arena from
there). All of it releases the GIL. Any other load (fp8_per_tensor,
converted, native FP8, cuda-ipc, a GPU without e4m3) is preloadd/loader.py's, which
shares with this file the arena's plan and publishing and the manifest.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from preload.checkpoint.config import ModelConfig
from preload.checkpoint.finite import all_finite
from preload.checkpoint.headers import CheckpointError, StoredTensor, read_headers
from preload.checkpoint.identity import AUX_FILES, checkpoint_record, describe, digest, fingerprint
from preload.checkpoint.pages import populate
from preload.checkpoint.shapes import wanted_shapes
from preload.ipc import finite_device, fp8_device
from preload.ipc.arena import create_arena
from preload.ipc.devices import ordinal
from preload.ipc.layout import Layout, TensorEntry, pack
from preload.ipc.manifest import FILE_PREFIX, Manifest
from preload.kernels.precision import stored_specs
from preload.preloadd.weights import Loaded, LoadError, Progress

LOADER_THREADS = 16
POPULATE_CHUNK = 64 << 20  # bytes of a tensor's pages mapped in at once (a stop is seen between two)
WIDENED = ("bfloat16", "float16")  # to float32, exactly


def aux_files(model_dir: Path) -> dict[str, bytes]:
    """The config and tokenizer files, stored in the arena beside the weights."""
    return {name: (model_dir / name).read_bytes() for name in AUX_FILES if (model_dir / name).exists()}


def aux_specs(files: dict[str, bytes]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(FILE_PREFIX + name, "uint8", (len(data),)) for name, data in files.items()]


def check_memory(size: int, device: str) -> None:
    if device == "cpu":
        available = psutil.virtual_memory().available
        if size > available:
            raise LoadError(f"not enough host memory for the arena: need {size / 2**30:.2f} GiB,"
                            f" {available / 2**30:.2f} GiB available")


def nonfinite(path: Path, what: str) -> LoadError:
    return LoadError(f"{path}: tensor {what} holds NaN or Inf values; every request would fail")


def publish(arena, by_name: dict[str, TensorEntry], files: dict[str, bytes], progress: Progress) -> None:
    """The config and tokenizer files in, then the seals on."""
    with progress.timed("publish"):
        for name, data in files.items():
            arena.write_part(by_name[FILE_PREFIX + name], 0, memoryview(data))
            progress.tensors_done += 1
        arena.seal()


def manifest_of(model_dir: Path, files: dict[str, bytes], quant: str, dtype: str, device: str, arena,
                entries: list[TensorEntry], digests: dict[str, str], sources: dict[str, Path]) -> Manifest:
    settings = {"quant": quant, "dtype": dtype}
    record = checkpoint_record(model_dir, digests, sources)
    return Manifest(model=str(model_dir), config=json.loads(files["config.json"]), **settings, device=device,
                    arena=arena.info(), layout=Layout.of(entries), record=record,
                    fingerprint=fingerprint(record.aux, digests, settings))


@dataclass
class CopyPlan:
    stored: dict[str, StoredTensor]  # the source of each weight, in the config's order
    quantized: dict[str, tuple[str, str]]  # weight -> its e4m3 and scale entries (fp8_block on a GPU)
    entries: list[TensorEntry]
    size: int
    files: dict[str, bytes]
    checked_on_device: bool  # NaN/Inf checked by the GPU in the arena, not by the loader threads


def copy_plan(model_dir: Path, quant: str, dtype: str, transport: str, device: str) -> CopyPlan | None:
    """The plan of a load this file can do, or None if this one needs torch (or the
    checkpoint is faulty: preloadd/loader.py then says how, as for any load): weights
    kept as stored, and with fp8_block into GPU memory that can quantize them, bf16
    matrices quantized on the way (ipc/fp8_device.py)."""
    quantizing = quant == "fp8_block" and transport == "cuda-vmm" and fp8_device.available(ordinal(device))
    if not (quant == "none" or quantizing) or transport not in ("memfd", "cuda-vmm"):
        return None
    try:
        cfg = ModelConfig.from_dir(model_dir)
        headers = read_headers(model_dir)
    except (CheckpointError, OSError, ValueError):
        return None
    stored, quantized, specs = {}, {}, []
    for name, shape in wanted_shapes(cfg, headers).items():
        source, wanted = headers.get(name), stored_specs(name, shape, quant, dtype)
        if source is None or source.shape != shape:
            return None
        if len(wanted) == 2:  # e4m3 and its scales, from a bf16 matrix
            if source.dtype != "bfloat16" or len(shape) != 2:
                return None
            quantized[name] = tuple(wanted)
        elif not (source.dtype == wanted[name][0] or (wanted[name][0] == "float32" and source.dtype in WIDENED)):
            return None
        stored[name] = source
        specs += [(stored_name, dt, s) for stored_name, (dt, s) in wanted.items()]
    files = aux_files(model_dir)
    entries, size = pack(specs + aux_specs(files))
    checked_on_device = transport == "cuda-vmm" and finite_device.available(ordinal(device))
    return CopyPlan(stored, quantized, entries, size, files, checked_on_device)


def load_copied(model_dir: Path, quant: str, dtype: str, device: str, transport: str, progress: Progress,
                on_progress: Callable[[Progress], None] = lambda p: None, plan: CopyPlan | None = None) -> Loaded | None:
    """Load `model_dir` as preloadd/loader.py would (the same arena bytes, layout and
    fingerprint), without torch; None if this load needs arithmetic (nothing done then).
    `plan`: copy_plan's, if the caller has it already."""
    progress.started = time.monotonic()  # the load alone: not the imports or the daemon's start before it
    if plan is None:
        with progress.timed("plan"):
            plan = copy_plan(model_dir, quant, dtype, transport, device)
    if plan is None:
        return None
    by_name = {e.name: e for e in plan.entries}
    progress.total_bytes, progress.tensors_total = plan.size, len(plan.entries)
    check_memory(plan.size, device)
    arena = create_arena(transport, plan.size, device)
    digests, lock = {}, threading.Lock()
    maps, addresses = {}, {}
    try:
        for path in sorted({s.path for s in plan.stored.values()}):
            with open(path, "rb") as f:
                maps[path] = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
            addresses[path] = np.frombuffer(maps[path], dtype=np.uint8).ctypes.data  # (the array goes at once)

        copying_in = "write" if transport == "memfd" else "upload"  # (into device memory: an upload)
        in_file_order = sorted(plan.stored, key=lambda n: (plan.stored[n].path, plan.stored[n].start))

        def store(tag: int, name: str) -> None:
            source, entry = plan.stored[name], by_name[name]
            quantized = plan.quantized.get(name)
            widen = entry.dtype != source.dtype and not quantized
            on_device = plan.checked_on_device and finite_device.checkable(source.dtype if quantized else entry.dtype)
            spent = {"read": 0.0, copying_in: 0.0}
            t = time.perf_counter()
            for at in range(source.start, source.end, POPULATE_CHUNK):  # (pages.py)
                progress.check()
                populate(addresses[source.path] + at, min(POPULATE_CHUNK, source.end - at))
            spent["read"] = time.perf_counter() - t

            def visit(_part: int, at: int, chunk: memoryview) -> None:
                progress.check()
                if not on_device and not all_finite(source.dtype, chunk):
                    raise nonfinite(source.path, name)
                t = time.perf_counter()
                if quantized:
                    arena.stage_part(at, chunk, source.end - source.start)
                elif widen:
                    arena.write_part(entry, at * 2, memoryview(widened(source.dtype, chunk)).cast("B"))
                else:
                    arena.write_part(entry, at, chunk)
                spent[copying_in] += time.perf_counter() - t

            t, failure = time.perf_counter(), None
            try:
                with memoryview(maps[source.path]) as whole:
                    digests[name] = digest([(describe(source.dtype, source.shape), whole[source.start : source.end])], visit)
            except Exception as e:  # raised again without its frames: they hold views that keep the mapping open
                failure = e.with_traceback(None)
            if failure is not None:
                raise failure
            spent["hash"] = time.perf_counter() - t - spent[copying_in]
            if on_device:  # (queued behind this tensor's copies; the tag says which tensor it was)
                t = time.perf_counter()
                if quantized:
                    arena.check_staged_finite(source.end - source.start, source.dtype, tag)
                else:
                    arena.check_finite(entry, tag)
                spent[copying_in] += time.perf_counter() - t
            if quantized:
                t = time.perf_counter()
                arena.write_fp8_block(*(by_name[n] for n in quantized))  # (queued behind the copies)
                spent["quantize"] = time.perf_counter() - t
            written = [by_name[n] for n in quantized or (name,)]
            with lock:
                progress.add(spent)
                progress.done_bytes += sum(e.nbytes for e in written)
                progress.tensors_done += len(written)
                on_progress(progress)

        with ThreadPoolExecutor(min(LOADER_THREADS, os.cpu_count() or 1), thread_name_prefix="load") as pool:
            futures = [pool.submit(store, tag, name) for tag, name in enumerate(in_file_order, start=1)]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        bad = arena.first_nonfinite() if plan.checked_on_device else 0
        if bad:
            name = in_file_order[bad - 1]
            raise nonfinite(plan.stored[name].path, name)
        publish(arena, by_name, plan.files, progress)
    except BaseException:
        arena.close()  # the last fd: the memory is gone with it
        raise
    finally:
        for m in maps.values():
            try:
                m.close()
            except BufferError:  # a view still held by a failed store's traceback: unmapped when it goes
                pass
    progress.done_bytes = plan.size
    progress.seconds = time.monotonic() - progress.started
    sources = {name: s.path for name, s in plan.stored.items()}
    manifest = manifest_of(model_dir, plan.files, quant, dtype, device, arena, plan.entries, digests, sources)
    return Loaded(arena, manifest)


def widened(dtype: str, chunk: memoryview) -> np.ndarray:
    """A bfloat16 or float16 chunk as float32 (exact: bfloat16 is float32's upper half)."""
    if dtype == "bfloat16":
        return np.frombuffer(chunk, dtype=np.uint16).astype(np.uint32) << 16
    return np.frombuffer(chunk, dtype=np.float16).astype(np.float32)
