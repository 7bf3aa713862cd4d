"""Cold start: `preload start` to ready, against only reading the checkpoint's files.

Everything is measured on this machine in one run, so the ratios compare like with like:
1. read every *.safetensors file fully with large sequential reads into one reusable
   buffer, once "cold-ish" (whatever the page cache holds; `evict=True` drops the files
   from it first) and then `repeat` times warm;
2. for each quant mode, `repeat` times (after one unrecorded warm-up launch): run the
   real `preload start --model M --quant Q --state-dir TMP --health-port FREE` as a
   subprocess until it exits 0 (= ready), polling the process tree's memory every 20 ms,
   read the daemon's own /status (load_seconds, arena bytes) and kernel peak RSS
   (VmHWM), then `preload stop`. The files are warm in the page cache throughout.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

QUANTS = ("none", "fp8_per_tensor", "fp8_block")
POLL_S = 0.02
READ_BUFFER = 64 * 2**20
MiB = 2**20

# ---- the checkpoint ------------------------------------------------------------------


def checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    return files


def largest_tensor(files: list[Path]) -> tuple[str, int]:
    """The biggest tensor by bytes, from the safetensors headers alone."""
    best = ("", 0)
    for path in files:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                size = info["data_offsets"][1] - info["data_offsets"][0]
                best = max(best, (name, size), key=lambda x: x[1])
    return best


def evict_from_page_cache(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (dirty pages are written back first)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(files: list[Path], buffer: bytearray) -> tuple[float, int]:
    """Seconds and bytes to read every file start to end into `buffer`, chunk after chunk."""
    view = memoryview(buffer)
    total = 0
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return time.perf_counter() - t0, total


# ---- one `preload start` ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preload_command() -> list[str]:
    """The installed `preload` script next to this interpreter, else `python -m`."""
    script = Path(sys.executable).parent / "preload"
    return [str(script)] if script.exists() else [sys.executable, "-m", "preload.cli.main"]


def proc_memory(pid: int) -> dict[str, int]:
    """Resident bytes of one process from /proc/PID/status: total, anonymous, file-backed
    (page cache mapped in, e.g. an mmapped checkpoint), shmem (memfd arena), and peak."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem", "VmHWM": "hwm"}
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in fields:
                    out[fields[key]] = int(value.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.05)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _http_json(port: int, path: str) -> dict:
    # stdlib rather than httpx: httpx is only a test extra, and `preload bench` must run
    # wherever `preload` does.
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


@dataclass
class StartRun:
    quant: str
    start_to_ready_s: float = 0.0
    daemon_spawned_s: float | None = None  # launch -> daemon process seen (launcher's own start)
    port_open_s: float | None = None  # launch -> health port accepting (daemon's imports done)
    load_seconds: float = 0.0  # the daemon's own figure (/status)
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
    launcher_output: str = ""


def run_start(model: Path, quant: str, device: str, timeout: float = 600.0) -> StartRun:
    """Launch the real `preload start`, time it to ready, sample memory, then stop it."""
    run = StartRun(quant)
    state_dir = Path(tempfile.mkdtemp(prefix="preload-bench-"))
    port = free_port()
    base = preload_command()
    cmd = [*base, "start", "--model", str(model), "--quant", quant, "--device", device,
           "--state-dir", str(state_dir), "--health-port", str(port)]
    launcher: subprocess.Popen | None = None
    daemon: psutil.Process | None = None  # kept as an object: psutil refuses to signal a reused pid
    try:
        t0 = time.perf_counter()
        launcher = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        root = psutil.Process(launcher.pid)
        while True:
            now = time.perf_counter() - t0
            done = launcher.poll() is not None
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = []
            if daemon is None and len(tree) > 1:
                daemon, run.daemon_spawned_s = tree[1], now
            total = 0
            for p in tree:
                mem = proc_memory(p.pid)
                total += mem.get("rss", 0)
                if daemon is not None and p.pid == daemon.pid:
                    for k in ("rss", "anon", "file", "shmem"):
                        run.peak_daemon[k] = max(run.peak_daemon.get(k, 0), mem.get(k, 0))
            run.peak_tree_rss = max(run.peak_tree_rss, total)
            run.samples += 1
            if run.port_open_s is None and daemon is not None and _port_open(port):
                run.port_open_s = now
                run.at_port_open = proc_memory(daemon.pid)
            if done:
                break
            if now > timeout:
                raise TimeoutError(f"preload start ({quant}) not ready after {timeout:.0f} s")
            time.sleep(POLL_S)
        run.start_to_ready_s = time.perf_counter() - t0
        run.launcher_output = launcher.stdout.read().decode(errors="replace").strip()
        if launcher.returncode != 0:
            log = state_dir / "daemon.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"preload start --quant {quant} exited {launcher.returncode}: {run.launcher_output}\n{tail}")

        status = _http_json(port, "/status")
        if daemon is None or daemon.pid != status["pid"]:
            daemon = psutil.Process(status["pid"])
        daemon_pid = daemon.pid
        run.load_seconds = float(status["load_seconds"])
        run.overhead_s = run.start_to_ready_s - run.load_seconds
        run.arena_bytes = int(sum(status["bytes_per_device"].values()))
        run.device = status["device"]
        mem = proc_memory(daemon_pid)
        run.daemon_hwm = mem.get("hwm", 0)
        for k in ("rss", "anon", "file", "shmem"):  # the last 20 ms before ready may have been missed
            run.peak_daemon[k] = max(run.peak_daemon.get(k, 0), mem.get(k, 0))
        full = daemon.memory_full_info()
        run.after_ready = {"rss": full.rss, "uss": full.uss, "pss": full.pss, "shared": full.shared,
                           **{k: mem.get(k, 0) for k in ("anon", "file", "shmem")}}

        t1 = time.perf_counter()
        stop = subprocess.run([*base, "stop", "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=60)
        run.stop_s = time.perf_counter() - t1
        if stop.returncode != 0:
            raise RuntimeError(f"preload stop exited {stop.returncode}: {stop.stdout}{stop.stderr}")
        return run
    finally:
        _reap(launcher, daemon)
        shutil.rmtree(state_dir, ignore_errors=True)


def _reap(launcher: subprocess.Popen | None, daemon: psutil.Process | None) -> None:
    """Whatever went wrong, leave no daemon behind: SIGTERM, then SIGKILL."""
    procs = [daemon] if daemon is not None and daemon.is_running() else []
    if launcher is not None and launcher.poll() is None:
        procs.append(psutil.Process(launcher.pid))
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    if launcher is not None:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        if launcher.stdout:
            launcher.stdout.close()


# ---- the whole benchmark -----------------------------------------------------------------


def host_info(device: str) -> dict:
    """The machine a benchmark ran on, without touching CUDA."""
    import torch

    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device_requested": device,
    }


def machine_info(device: str) -> dict:
    import torch

    info = host_info(device) | {"cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_cold(
    model: Path,
    quants: list[str],
    repeat: int = 3,
    device: str = "auto",
    evict: bool = False,
    warmup: bool = True,
    transformers: bool = False,
    progress=lambda msg: None,
) -> dict:
    model = Path(model).absolute()
    files = checkpoint_files(model)
    big_name, big_bytes = largest_tensor(files)
    result: dict = {
        "benchmark": "cold",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(device),
        "loadavg_before": os.getloadavg(),
        "model": {
            "path": str(model),
            "files": [{"name": p.name, "bytes": p.stat().st_size} for p in files],
            "total_bytes": sum(p.stat().st_size for p in files),
            "largest_tensor": {"name": big_name, "bytes": big_bytes},
        },
        "repeat": repeat,
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
        "warm": {"runs_s": warm, **_summary(warm), "gb_per_s": nbytes / warm_s / 1e9},
    }
    del buffer

    # 2. `preload start` to ready, per quant mode, files warm.
    if warmup and quants:
        progress(f"warm-up launch (quant {quants[0]}, not recorded)")
        run_start(model, quants[0], device)
    starts = {}
    for quant in quants:
        runs = []
        for i in range(repeat):
            progress(f"preload start --quant {quant} ({i + 1}/{repeat})")
            runs.append(run_start(model, quant, device))
        ready = [r.start_to_ready_s for r in runs]
        load = [r.load_seconds for r in runs]
        starts[quant] = {
            "runs": [vars(r) for r in runs],
            "start_to_ready_s": _summary(ready),
            "load_seconds": _summary(load),
            "overhead_s": _summary([r.overhead_s for r in runs]),
            "port_open_s": _summary([r.port_open_s for r in runs if r.port_open_s is not None]),
            "stop_s": _summary([r.stop_s for r in runs]),
            "arena_bytes": runs[-1].arena_bytes,
            "peak_tree_rss": max(r.peak_tree_rss for r in runs),
            "peak_daemon_rss": max(r.peak_daemon.get("rss", 0) for r in runs),
            "peak_daemon_anon": max(r.peak_daemon.get("anon", 0) for r in runs),
            "peak_daemon_file": max(r.peak_daemon.get("file", 0) for r in runs),
            "peak_daemon_shmem": max(r.peak_daemon.get("shmem", 0) for r in runs),
            "daemon_hwm": max(r.daemon_hwm for r in runs),
            # growth from "imports done, health port open" to the peak: what loading itself costs
            "load_growth_anon": max(r.peak_daemon.get("anon", 0) - r.at_port_open.get("anon", 0) for r in runs),
            "load_growth_file": max(r.peak_daemon.get("file", 0) - r.at_port_open.get("file", 0) for r in runs),
            "ratio_ready_over_read_warm": statistics.median(ready) / warm_s,
            "ratio_ready_over_read_first": statistics.median(ready) / first_s,
            "ratio_load_over_read_warm": statistics.median(load) / warm_s,
        }
    result["start"] = starts
    if transformers:
        runs = []
        for i in range(repeat):
            progress(f"transformers from_pretrained ({i + 1}/{repeat})")
            runs.append(run_transformers(model, device))
        fresh = [r["process_s"] for r in runs]
        result["transformers"] = {
            "runs": runs,
            "process_s": _summary(fresh),
            "from_pretrained_s": _summary([r["from_pretrained_s"] for r in runs]),
            "ratio_over_read_warm": statistics.median(fresh) / warm_s,
        }
    result["machine"]["device"] = next((r["device"] for s in starts.values() for r in s["runs"]), None)
    result["loadavg_after"] = os.getloadavg()
    result["notes"] = [
        "read_files.first is whatever the page cache held at the time (cold only if evicted_before);"
        " the warm read and every `preload start` run with the files already in the page cache.",
        "start_to_ready_s: launch of `preload start` until it exits 0 (ready); load_seconds: the daemon's own"
        " figure from /status; overhead_s = start_to_ready_s - load_seconds (interpreters, imports, hand-off).",
        "Memory from /proc/PID/status polled every poll_interval_s; daemon_hwm is the kernel's exact peak RSS."
        " anon = private heap; shmem = the memfd arena; file = page cache mapped in (the mmapped checkpoint),"
        " which the kernel can drop; peak_tree_rss sums launcher and daemon. The memfd arena is written with"
        " pwrite and never mapped by the daemon, so it is not in the daemon's RSS: host memory while loading is"
        " RSS + arena_bytes. load_growth_* = peak minus the daemon's memory when its health port opened"
        " (imports done, load starting).",
    ]
    return result


TRANSFORMERS_LOAD = """
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
t1 = time.perf_counter()
device = sys.argv[2]
# device_map needs accelerate on CPU, where the weights land on the CPU anyway
placement = {"device_map": device} if device != "cpu" else {}
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, **placement)
if device.startswith("cuda"):
    torch.cuda.synchronize()
print(json.dumps({"import_s": t1 - t0, "from_pretrained_s": time.perf_counter() - t1}))
"""


def run_transformers(model: Path, device: str) -> dict:
    """The naive restart: a fresh process that imports transformers and loads the same
    files with `from_pretrained(..., device_map=device)` (bf16)."""
    device = ("cuda:0" if _cuda_available() else "cpu") if device == "auto" else device
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", TRANSFORMERS_LOAD, str(model), device], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"transformers could not load {model}: {out.stderr.strip().splitlines()[-1:]}")
    return {"process_s": time.perf_counter() - t0, **json.loads(out.stdout.strip().splitlines()[-1])}


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _sec(x: float) -> str:
    return f"{x:.3f}"


def _ratio(x: float) -> str:
    return f"{x:.2f}x" if x < 10 else f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def _dur(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 0.1 else f"{x:.3f} s"


def _size(n: int) -> str:
    return f"{n / 2**10:.1f} KiB" if n < MiB else f"{n / MiB:.1f} MiB"


def format_table(result: dict) -> str:
    m, rf = result["model"], result["read_files"]
    mach = result["machine"]
    first, warm = rf["first"], rf["warm"]
    lines = [
        f"preload bench cold: {m['path']} ({m['total_bytes'] / 1e9:.3f} GB in {len(m['files'])} file(s),"
        f" largest tensor {_size(m['largest_tensor']['bytes'])})",
        f"machine: {mach['hostname']}, {mach['cpus_usable']} CPUs, torch {mach['torch']},"
        f" device {mach.get('device') or mach['device_requested']}, load avg {result['loadavg_before'][0]:.2f}",
        f"read files alone ({rf['buffer_bytes'] // MiB} MiB sequential reads):"
        f" first {_dur(first['seconds'])} ({first['gb_per_s']:.2f} GB/s, "
        + ("evicted first" if first["evicted_before"] else "cold-ish: page cache as found")
        + f"), warm {_dur(warm['median'])} ({warm['gb_per_s']:.2f} GB/s)",
        "everything below ran with the files warm in the page cache; times are medians of"
        f" {result['repeat']} run(s)",
    ]
    runs = [r for s in result["start"].values() for r in s["runs"]]
    spawned = [r["daemon_spawned_s"] for r in runs if r["daemon_spawned_s"] is not None]
    port = [r["port_open_s"] for r in runs if r["port_open_s"] is not None]
    if spawned and port:
        lines.append(
            f"where the overhead goes (median of all runs): launch -> daemon process started"
            f" {statistics.median(spawned):.3f} s, -> health port open (daemon's imports done, load starts)"
            f" {statistics.median(port):.3f} s"
        )
    lines.append("")
    head = ("quant", "ready s", "load s", "ovhd s", "ready/read", "load/read", "arena MiB",
            "RSS MiB", "+anon", "+file", "stop s")
    widths = (15, 8, 8, 7, 10, 9, 9, 8, 7, 7, 6)
    lines.append("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for quant, s in result["start"].items():
        cells = (
            quant,
            _sec(s["start_to_ready_s"]["median"]),
            _sec(s["load_seconds"]["median"]),
            _sec(s["overhead_s"]["median"]),
            _ratio(s["ratio_ready_over_read_warm"]),
            _ratio(s["ratio_load_over_read_warm"]),
            f"{s['arena_bytes'] / MiB:.1f}",
            f"{s['daemon_hwm'] / MiB:.0f}",
            f"{s['load_growth_anon'] / MiB:.0f}",
            f"{s['load_growth_file'] / MiB:.0f}",
            _sec(s["stop_s"]["median"]),
        )
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    t = result.get("transformers")
    if t:
        lines.append(
            f"{'transformers':15}  fresh process {t['process_s']['median']:.3f} s ({_ratio(t['ratio_over_read_warm'])} the read),"
            f" from_pretrained alone {t['from_pretrained_s']['median']:.3f} s"
        )
    lines += [
        "",
        "ready: `preload start` launch to exit 0; load: the daemon's /status load_seconds; ovhd = ready - load"
        " (interpreter start, imports, hand-off); x/read: over the warm file read.",
        "RSS: the daemon's kernel peak (VmHWM); +anon/+file: growth of its heap / mapped checkpoint pages from"
        " health port open to the peak (polled every 20 ms).",
        "The memfd arena is written with pwrite and never mapped by the daemon: host memory while loading is"
        " RSS + arena.",
    ]
    return "\n".join(lines)
