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
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from preload.bench.driver import free_port, preload, running_daemon
from preload.bench.file_reads import (cat_files, checkpoint_files, evict_from_page_cache, import_torch, largest_tensor,
                                      read_files)
from preload.bench.gpu import Gpu
from preload.bench.memory import proc_memory
from preload.bench.results import MiB, begin, finish, quantiles, row
from preload.kernels import ahead
from preload.preloadd.state_dir import KERNEL_CACHE_ENV

POLL_S = 0.02
READ_BUFFER = 64 * MiB

# ---- one `preload start` ---------------------------------------------------------------


@dataclass
class StartRun:
    quant: str
    start_to_ready_s: float = 0.0
    daemon_spawned_s: float | None = None  # launch -> daemon process seen (launcher's own start)
    port_open_s: float | None = None  # launch -> health port accepting (daemon's imports done)
    load_seconds: float = 0.0  # the daemon's own figure (/status)
    stage_seconds: dict[str, float] = field(default_factory=dict)  # the load's stages (/status; loader.Progress)
    overhead_s: float = 0.0  # start_to_ready - load_seconds: interpreters, imports, hand-off
    stop_s: float = 0.0
    arena_bytes: int = 0
    device: str = ""  # as the daemon resolved --device (/status)
    samples: int = 0
    peak_tree_rss: int = 0  # sum over launcher + daemon + any children, polled
    peak_daemon: dict[str, int] = field(default_factory=dict)  # polled per field: rss, anon, file, shmem
    daemon_hwm: int = 0  # kernel's peak RSS of the daemon (VmHWM), read once ready
    at_port_open: dict[str, int] = field(default_factory=dict)  # daemon memory once imported, before loading
    after_ready: dict[str, int] = field(default_factory=dict)  # daemon: rss, uss, pss, shared, anon, file, shmem
    worker_log: list[str] = field(default_factory=list)  # with workers: the daemon's and worker 0's log lines (start_lines)
    first_request_s: float | None = None  # with workers: the first request once ready (first_request)
    restore: dict | None = None  # with --restore: the daemon's /status word on it (restored, or why not)
    settled_s: float | None = None  # a first start: ready -> nothing left to capture or compile while idle (settle)

    def sample(self, tree: list[psutil.Process], daemon: psutil.Process | None, port: int, now: float) -> None:
        """One poll of the launcher's process tree while it starts."""
        total = 0
        for p in tree:
            mem = proc_memory(p.pid)
            total += mem.get("rss", 0)
            if daemon is not None and p.pid == daemon.pid:
                for k in ("rss", "anon", "file", "shmem"):
                    self.peak_daemon[k] = max(self.peak_daemon.get(k, 0), mem.get(k, 0))
        self.peak_tree_rss = max(self.peak_tree_rss, total)
        self.samples += 1
        if self.port_open_s is None and daemon is not None and _accepting(port):
            self.port_open_s, self.at_port_open = now, proc_memory(daemon.pid)


def run_start(model: Path, quant: str, device: str, workers: int, restore: Path | None = None,
              settled: bool = False) -> StartRun:
    """Launch the real `preload start`, time it to ready, sample memory, then stop it;
    `restore`: with --restore (its zygote from that snapshot; a start that did not take it fails);
    `settled`: stopped only once its worker has nothing left to capture or compile (settle)."""
    run = StartRun(quant)
    port = free_port()
    extra = (("--workers", workers, "--spare-workers", 0) if workers else ()) + (("--restore", restore) if restore else ())
    done = threading.Event()

    def sampler() -> None:  # this process's descendants: the launcher, then the daemon it spawns
        while not done.is_set():
            now = time.perf_counter() - t0
            tree = psutil.Process().children(recursive=True)
            daemon = next((p for p in tree if _is_daemon(p)), None)
            if daemon is not None and run.daemon_spawned_s is None:
                run.daemon_spawned_s = now
            run.sample(tree, daemon, port, now)
            done.wait(POLL_S)

    t0 = time.perf_counter()
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        with running_daemon(model, "--quant", quant, "--device", device, *extra, port=port,
                            api_port=free_port() if workers else None) as d:
            run.start_to_ready_s = time.perf_counter() - t0
            done.set()
            thread.join()
            status = d.status()
            run.load_seconds = float(status["load_seconds"])
            run.stage_seconds = status["progress"].get("stage_seconds", {})
            run.overhead_s = run.start_to_ready_s - run.load_seconds
            run.arena_bytes = int(sum(status["bytes_per_device"].values()))
            run.device = status["device"]
            run.restore = status.get("restore")
            if restore and not (run.restore or {}).get("restored"):
                raise RuntimeError(f"the start did not take --restore {restore}: {(run.restore or {}).get('why')}")
            mem = proc_memory(d.pid)
            run.daemon_hwm = mem.get("hwm", 0)
            for k in ("rss", "anon", "file", "shmem"):  # the last 20 ms before ready may have been missed
                run.peak_daemon[k] = max(run.peak_daemon.get(k, 0), mem.get(k, 0))
            full = psutil.Process(d.pid).memory_full_info()
            run.after_ready = {"rss": full.rss, "uss": full.uss, "pss": full.pss, "shared": full.shared,
                               **{k: mem.get(k, 0) for k in ("anon", "file", "shmem")}}
            if workers:
                run.first_request_s, marks = first_request(d.api_port)
                if settled:
                    run.settled_s = settle(d.api_port, run.start_to_ready_s + t0)
                run.worker_log = sorted(start_lines(Path(d.state_dir)) + marks)
            t1 = time.perf_counter()
            stop = preload("stop", "--state-dir", d.state_dir)
            run.stop_s = time.perf_counter() - t1
            if stop.returncode != 0:
                raise RuntimeError(f"preload stop exited {stop.returncode}: {stop.stdout}{stop.stderr}")
    finally:
        done.set()
    return run


START_LINES = {"daemon.log": ("zygote launched", "health port", "loading ", "loaded in", "ready in", "zygote ready",
                              "worker 0 started", "worker 0 ready", "kernels compiled ahead"),
               "worker-0.log": ("arena mapped in", "weights attached in", "first step", "captured", "KV cache",
                                "ready in", "after the first request came", "kernels this process"),
               "front-0.log": ("ready in",)}


SETTLE_TIMEOUT = 300.0  # seconds a first start's worker may take to capture and compile all it does while idle


def settle(port: int, ready_at: float) -> float | None:
    """Seconds from `ready_at` (perf_counter) until the workers' /metrics show no graph or
    warm-up pending; None if some still are after SETTLE_TIMEOUT. A first start fills the
    kernel cache the warm starts after it use: stopped at its first answer, before its idle
    captures reach batch 4, it left the next start to compile that batch's MLA kernels while
    its first request waited (docs/cold-start.md)."""
    import httpx

    while time.perf_counter() - ready_at < SETTLE_TIMEOUT:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        pending = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("preload_engine_graphs_pending")]
        if pending and sum(pending) == 0:
            return time.perf_counter() - ready_at
        time.sleep(0.2)
    return None


FIRST_PROMPT = list(range(1, 33))  # token ids: a prompt runs eagerly, not in a decode graph


def first_request(port: int) -> tuple[float, list[str]]:
    """Seconds the first request to a worker just ready takes: 32 prompt tokens, 4 out. What
    a start leaves to its first request (kernels no step of the start ran) shows here; and
    two lines as the logs' (when it was sent, when answered), which sort among theirs (the
    core's first steps, worker/core.py) into one timeline."""
    import httpx  # (the bench extra's: a start without workers needs none)

    sent, t = time.time(), time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                   json={"prompt": FIRST_PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    took = time.perf_counter() - t
    if r.status_code != 200:
        raise RuntimeError(f"the first request failed: {r.status_code} {r.text[:300]}")
    return took, [log_line(sent, "bench: the first request sent"), log_line(sent + took, "bench: its answer received")]


def log_line(at: float, text: str) -> str:
    """`text` as a line of the project's logs at wall time `at` (logging's asctime: local time)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f",{int(at * 1000) % 1000:03d} {text}"


def start_lines(state_dir: Path) -> list[str]:
    """The lines of the daemon's, worker 0's and its front's logs that time a start, in time
    order (each line begins with its time stamp)."""
    return sorted(line for name, phrases in START_LINES.items() if (state_dir / name).exists()
                  for line in (state_dir / name).read_text().splitlines() if any(phrase in line for phrase in phrases))


def _accepting(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.05)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _is_daemon(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
        # Once titled; before that, the fork of the `preload start` we launched: its child, same command line.
        return cmd.startswith("preload daemon") or (p.ppid() != os.getpid() and " start " in f" {cmd} ")
    except psutil.Error:
        return False


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
