"""Cold start: `preload start` to ready, against only reading the checkpoint's files
(and, with `transformers`, against transformers loading the same files).

Everything is measured on this machine in one run, so the ratios compare like with like:
1. read every *.safetensors file fully with large sequential reads into one reusable
   buffer, once "cold-ish" (whatever the page cache holds; `evict=True` drops the files
   from it first) and then `repeat` times warm; then `cat` them `repeat` times (the
   targets' reference) and time `python -c 'import torch'` as often;
2. with workers, for each quant mode a first start with no GPU kernels compiled yet (a
   machine's first) and one whose cache holds only the list of kernels that start recorded
   (an image's or a copied list: compiled beside the load), recorded apart; then for each
   quant mode, `repeat` times (after one unrecorded warm-up launch, or those first starts):
   run the real `preload start` (with `workers` workers, if any: it returns once they are
   ready) until it exits 0, sampling the memory of its process tree every 20 ms; read the
   daemon's own /status (load_seconds, arena bytes) and its kernel peak RSS (VmHWM); time
   `preload stop`. The files are warm in the page cache throughout.
The memfd arena is written with pwrite and never mapped by the daemon, so it is not in
the daemon's RSS: host memory while loading is RSS + arena.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from preload.bench.driver import preload
from preload.bench.file_reads import (cat_files, checkpoint_files, evict_from_page_cache, import_torch, largest_tensor,
                                      read_files)
from preload.bench.gpu import Gpu
from preload.bench.results import MiB, begin, finish, quantiles, row
from preload.bench.start_run import POLL_S, SETTLE_TIMEOUT, StartRun, run_start
from preload.kernels import ahead
from preload.preloadd.state_dir import KERNEL_CACHE_ENV

READ_BUFFER = 64 * MiB

# ---- the whole benchmark -----------------------------------------------------------------


def run_cold(model: Path, quants: list[str], repeat: int = 3, device: str = "auto", evict: bool = False,
             warmup: bool = True, transformers: bool = False, workers: int = 0, snapshot: bool = False,
             progress=lambda msg: None) -> dict:
    model = Path(model).absolute()
    files = checkpoint_files(model)
    big_name, big_bytes = largest_tensor(files)
    t0 = time.perf_counter()
    result = begin("cold", device, Gpu.for_device(device)) | {
        "model": {
            "path": str(model),
            "files": [{"name": p.name, "bytes": p.stat().st_size} for p in files],
            "total_bytes": sum(p.stat().st_size for p in files),
            "largest_tensor": {"name": big_name, "bytes": big_bytes},
        },
        "repeat": repeat,
        "workers": workers,
        "poll_interval_s": POLL_S,
    }

    # 1. reading the files alone: first (cold-ish), then warm.
    buffer = bytearray(READ_BUFFER)
    if evict:
        evict_from_page_cache(files)
    progress("reading the checkpoint files" + (" (evicted from the page cache first)" if evict else ""))
    first_s, nbytes = read_files(files, buffer)
    warm = [read_files(files, buffer)[0] for _ in range(max(repeat, 1))]
    warm_s = statistics.median(warm)
    result["read_files"] = {
        "bytes": nbytes,
        "buffer_bytes": READ_BUFFER,
        "first": {"seconds": first_s, "gb_per_s": nbytes / first_s / 1e9, "evicted_before": evict},
        "warm": {"runs_s": warm, **quantiles(warm), "gb_per_s": nbytes / warm_s / 1e9},
    }
    del buffer
    cat = [cat_files(files) for _ in range(max(repeat, 1))]
    result["cat_files"] = {"runs_s": cat, **quantiles(cat)}
    torch_s = [import_torch() for _ in range(max(repeat, 1))]
    result["import_torch"] = {"runs_s": torch_s, **quantiles(torch_s)}

    # 2. `preload start` to ready, per quant mode, files warm. Workers compile their GPU
    # kernels into a cache of this run's own (kernel_cache_dir), empty at first: the first
    # start compiles them all, as a machine's first start does, and is kept apart.
    with tempfile.TemporaryDirectory(prefix="preload-bench-kernels-") as kernels:
        saved = os.environ.get(KERNEL_CACHE_ENV)
        os.environ[KERNEL_CACHE_ENV] = kernels
        try:
            if workers:  # (each quant mode has kernels of its own)
                result["first_start"] = {}
                for quant in quants:
                    progress(f"first start, no kernels compiled yet (quant {quant}, recorded apart)")
                    result["first_start"][quant] = asdict(run_start(model, quant, device, workers, settled=True))
                    if ahead.list_path(kernels).exists():  # (GPU workers record one)
                        for kind, said in (("listed", "holding only the list the first recorded"),
                                           ("imaged", "that list was compiled into first, as an image's build does")):
                            progress(f"first start on a cache {said} (quant {quant})")
                            result["first_start"][f"{quant} {kind}"] = listed_start(
                                model, quant, device, workers, Path(kernels), compiled=kind == "imaged")
                for run in result["first_start"].values():
                    run["ratio_ready_over_cat"] = run["start_to_ready_s"] / result["cat_files"]["p50"]
            elif warmup and quants:
                progress(f"warm-up launch (quant {quants[0]}, not recorded)")
                run_start(model, quants[0], device, workers)
            def timed(quant: str, restore: Path | None = None) -> dict:
                """`repeat` starts, summarized, with their ratios over `cat` of the files."""
                said = f"preload start --quant {quant}" + (" --restore" if restore else "")
                runs = []
                for i in range(repeat):
                    progress(f"{said} ({i + 1}/{repeat})")
                    runs.append(run_start(model, quant, device, workers, restore))
                s = summarize_starts(runs, warm_s, first_s)
                s["ratio_ready_over_cat"] = s["start_to_ready_s"]["p50"] / result["cat_files"]["p50"]
                s["ratio_load_over_cat"] = s["load_seconds"]["p50"] / result["cat_files"]["p50"]
                return s

            starts = {quant: timed(quant) for quant in quants}
            if snapshot:
                result["snapshot"] = restored_starts(quants, starts, timed, progress)
        finally:
            if saved is None:
                os.environ.pop(KERNEL_CACHE_ENV, None)
            else:
                os.environ[KERNEL_CACHE_ENV] = saved
    result["start"] = starts
    if transformers:
        runs = []
        for i in range(repeat):
            progress(f"transformers from_pretrained ({i + 1}/{repeat})")
            runs.append(run_transformers(model, device))
        result["transformers"] = {
            "runs": runs,
            "process_s": quantiles(r["process_s"] for r in runs),
            "from_pretrained_s": quantiles(r["from_pretrained_s"] for r in runs),
            "ratio_over_read_warm": statistics.median(r["process_s"] for r in runs) / warm_s,
        }
    result["machine"]["device"] = next((r["device"] for s in starts.values() for r in s["runs"]), None)
    return finish(result, t0)


def listed_start(model: Path, quant: str, device: str, workers: int, cache: Path, compiled: bool = False) -> dict:
    """A first start whose kernel cache holds only the list `cache`'s first start recorded
    (the zygote compiles them beside the load: kernels/ahead.py); `compiled`: the list compiled
    in first by `preload kernels compile`, no GPU visible, as deploy/Dockerfile's build does."""
    with tempfile.TemporaryDirectory(prefix="preload-bench-listed-") as listed:
        shutil.copy(ahead.list_path(cache), ahead.list_path(listed))
        os.environ[KERNEL_CACHE_ENV] = listed
        try:
            extra: dict = {"listed": True}
            if compiled:
                t0 = time.perf_counter()
                done = preload("kernels", "compile", timeout=SETTLE_TIMEOUT, env={"CUDA_VISIBLE_DEVICES": ""})  # (no GPU)
                if done.returncode not in (0, 3):  # (3: some left to the JIT, as the Dockerfile allows)
                    raise RuntimeError(f"kernels compile exited {done.returncode}: {done.stdout}{done.stderr}")
                extra = {"imaged": True, "compile_s": time.perf_counter() - t0, "compile_said": done.stdout.strip()}
            return asdict(run_start(model, quant, device, workers)) | extra
        finally:
            os.environ[KERNEL_CACHE_ENV] = str(cache)


def restored_starts(quants: list[str], starts: dict, timed, progress) -> dict:
    """`preload snapshot` (a zygote, its imports done: preloadd/snapshot.py), then the same
    starts with --restore (`timed`), into `starts` as "<quant> --restore"; what
    snapshot.json says."""
    with tempfile.TemporaryDirectory(prefix="preload-bench-snapshot-") as tmp:
        dest = Path(tmp) / "snapshot"
        progress("preload snapshot (CRIU)")
        taken = preload("snapshot", dest)
        if taken.returncode != 0:
            raise RuntimeError(f"preload snapshot exited {taken.returncode}: {taken.stdout}{taken.stderr}")
        for quant in quants:
            starts[f"{quant} --restore"] = timed(quant, dest)
        return json.loads((dest / "snapshot.json").read_text())


def summarize_starts(runs: list[StartRun], warm_s: float, first_s: float) -> dict:
    ready = statistics.median(r.start_to_ready_s for r in runs)
    load = statistics.median(r.load_seconds for r in runs)
    peak = lambda k: max(r.peak_daemon.get(k, 0) for r in runs)  # noqa: E731
    # growth from "imports done, health port open" to the peak: what loading itself costs
    growth = lambda k: max(r.peak_daemon.get(k, 0) - r.at_port_open.get(k, 0) for r in runs)  # noqa: E731
    return {
        "runs": [asdict(r) for r in runs],
        "start_to_ready_s": quantiles(r.start_to_ready_s for r in runs),
        "load_seconds": quantiles(r.load_seconds for r in runs),
        "overhead_s": quantiles(r.overhead_s for r in runs),
        "port_open_s": quantiles(r.port_open_s for r in runs),
        "stop_s": quantiles(r.stop_s for r in runs),
        "arena_bytes": runs[-1].arena_bytes,
        "peak_tree_rss": max(r.peak_tree_rss for r in runs),
        "peak_daemon_rss": peak("rss"),
        "peak_daemon_anon": peak("anon"),
        "peak_daemon_file": peak("file"),
        "peak_daemon_shmem": peak("shmem"),
        "daemon_hwm": max(r.daemon_hwm for r in runs),
        "load_growth_anon": growth("anon"),
        "load_growth_file": growth("file"),
        "ratio_ready_over_read_warm": ready / warm_s,
        "ratio_ready_over_read_first": ready / first_s,
        "ratio_load_over_read_warm": load / warm_s,
        "stage_seconds": {k: statistics.median(r.stage_seconds.get(k, 0.0) for r in runs) for k in runs[-1].stage_seconds},
        "worker_log": runs[-1].worker_log,
        "first_request_s": quantiles(r.first_request_s for r in runs) if runs[-1].first_request_s is not None else None,
    }


def run_transformers(model: Path, device: str) -> dict:
    """The naive restart: a fresh process that imports transformers and loads the same
    files (bench/transformers_load.py)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "preload.bench.transformers_load", str(model), device],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"transformers could not load {model}: {out.stderr.strip().splitlines()[-1:]}")
    return {"process_s": time.perf_counter() - t0, **json.loads(out.stdout.strip().splitlines()[-1])}


# ---- the table -------------------------------------------------------------------------


def _ratio(x: float) -> str:
    return f"{x:.2f}x" if x < 10 else f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def _dur(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 0.1 else f"{x:.3f} s"


def _size(n: int) -> str:
    return f"{n / 2**10:.1f} KiB" if n < MiB else f"{n / MiB:.1f} MiB"


def format_table(result: dict) -> str:
    m, rf, mach = result["model"], result["read_files"], result["machine"]
    first, warm = rf["first"], rf["warm"]
    workers = f", --workers {result['workers']} (ready = every worker ready)" if result.get("workers") else ""
    uncompiled = " and ".join(mach.get("compiled_from_source") or [])
    uncompiled = f" ({uncompiled} compiled from source at each import: no bytecode)" if uncompiled else ""
    lines = [
        f"preload bench cold: {m['path']} ({m['total_bytes'] / 1e9:.3f} GB in {len(m['files'])} file(s),"
        f" largest tensor {_size(m['largest_tensor']['bytes'])}){workers}",
        f"machine: {mach['hostname']}, {mach['cpus_usable']} CPUs, torch {mach['torch']}{uncompiled},"
        f" device {mach.get('device') or mach['device_requested']}, load avg {result['loadavg_before'][0]:.2f}",
        f"read files alone ({rf['buffer_bytes'] // MiB} MiB sequential reads):"
        f" first {_dur(first['seconds'])} ({first['gb_per_s']:.2f} GB/s, "
        + ("evicted first" if first["evicted_before"] else "cold-ish: page cache as found")
        + f"), warm {_dur(warm['p50'])} ({warm['gb_per_s']:.2f} GB/s)",
        f"everything below ran with the files warm in the page cache; times are medians of {result['repeat']} run(s)",
    ]
    if "cat_files" in result:  # (results from before these were taken have neither)
        lines.append(f"`cat` of the files {_dur(result['cat_files']['p50'])}; `python -c 'import torch'`"
                     f" {_dur(result['import_torch']['p50'])}")
    runs = [r for s in result["start"].values() for r in s["runs"]]
    spawned = [r["daemon_spawned_s"] for r in runs if r["daemon_spawned_s"] is not None]
    port = [r["port_open_s"] for r in runs if r["port_open_s"] is not None]
    if spawned and port:
        lines.append(f"where the overhead goes (median of all runs): launch -> daemon process started"
                     f" {statistics.median(spawned):.3f} s, -> health port open (daemon's imports done, load starts)"
                     f" {statistics.median(port):.3f} s")
    lines.append("")
    widths = (15, 8, 8, 7, 10, 9, 9, 8, 7, 7, 6)
    lines.append(row(("quant", "ready s", "load s", "ovhd s", "ready/read", "load/read", "arena MiB", "RSS MiB", "+anon",
                      "+file", "stop s"), widths))
    for quant, s in result["start"].items():
        lines.append(row((quant, *(f"{s[k]['p50']:.3f}" for k in ("start_to_ready_s", "load_seconds", "overhead_s")),
                          _ratio(s["ratio_ready_over_read_warm"]), _ratio(s["ratio_load_over_read_warm"]),
                          f"{s['arena_bytes'] / MiB:.1f}", f"{s['daemon_hwm'] / MiB:.0f}",
                          f"{s['load_growth_anon'] / MiB:.0f}", f"{s['load_growth_file'] / MiB:.0f}",
                          f"{s['stop_s']['p50']:.3f}"), widths))
    for quant, s in result["start"].items():
        if "ratio_ready_over_cat" in s:
            lines.append(f"{quant + ' vs cat':15}  ready {_ratio(s['ratio_ready_over_cat'])}, load"
                         f" {_ratio(s['ratio_load_over_cat'])} the time `cat` takes; ready - load"
                         f" {s['start_to_ready_s']['p50'] - s['load_seconds']['p50']:.3f} s against `import torch`'s"
                         f" {result['import_torch']['p50']:.3f} s")
    for quant, s in result["start"].items():
        stages = s.get("stage_seconds") or {}
        if stages:
            lines.append(f"{quant + ' load stages':15}  " + ", ".join(f"{k} {v:.3f}" for k, v in stages.items())
                         + " (seconds summed over the loader's threads)")
    for quant, s in result["start"].items():
        if s.get("worker_log"):
            first_request = s.get("first_request_s")  # (not in runs recorded before it was measured)
            then = f"; then its first request (32 prompt tokens, 4 out) {first_request['p50']:.3f} s" if first_request else ""
            lines.append(f"{quant + ' worker 0':15}  its start, from the daemon's and its log (the last run){then}:")
            lines += [f"{'':17}{line}" for line in s["worker_log"]]
    for quant, first in result.get("first_start", {}).items():
        said = (f"the list compiled into its kernel cache before, as an image's build does ({first['compile_s']:.1f} s)"
                if first.get("imaged") else "only the list in its kernel cache (compiled beside the load)"
                if first.get("listed") else "no kernels compiled yet")
        lines.append(f"{quant + ' first':15}  a first start, {said}: ready {first['start_to_ready_s']:.3f} s"
                     f" = {_ratio(first['ratio_ready_over_cat'])} `cat`, load {first['load_seconds']:.3f} s"
                     + (f", its first request {first['first_request_s']:.3f} s" if first.get("first_request_s") else "")
                     + (f", nothing left to capture or compile {first['settled_s']:.1f} s after ready"
                        if first.get("settled_s") is not None else "")
                     + "; from the logs:")
        lines += [f"{'':17}{line}" for line in first["worker_log"]]
    snap = result.get("snapshot")
    if snap:
        lines.append(f"{'snapshot':15}  `preload snapshot` (CRIU {snap['criu']}): a zygote after {snap['import_seconds']:.3f} s"
                     f" of imports, {snap['image_bytes'] / 1e6:.0f} MB of image, dumped in {snap['dump_seconds']:.3f} s;"
                     " the rows `--restore` start from it")
    t = result.get("transformers")
    if t:
        lines.append(f"{'transformers':15}  fresh process {t['process_s']['p50']:.3f} s"
                     f" ({_ratio(t['ratio_over_read_warm'])} the read), from_pretrained alone"
                     f" {t['from_pretrained_s']['p50']:.3f} s")
    lines += [
        "",
        "ready: `preload start` launch to exit 0; load: the daemon's /status load_seconds; ovhd = ready - load"
        " (interpreter start, imports, hand-off); x/read: over the warm file read.",
        "RSS: the daemon's kernel peak (VmHWM); +anon/+file: growth of its heap / mapped checkpoint pages from"
        " health port open to the peak (polled every 20 ms). Host memory while loading is RSS + arena.",
    ]
    return "\n".join(lines)
