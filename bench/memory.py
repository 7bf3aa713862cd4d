"""Memory: what the daemon, each worker and a spare hold, host memory and (on CUDA)
device memory, with 1 worker, 1 worker and a spare, and N workers; the weights must be
held once, whatever the number of workers.

Each layout is a daemon of its own (`preload start --workers N --spare-workers K`),
measured once every worker is ready and every spare in standby. Host memory per process
(psutil and /proc/PID/status): USS counts pages this process alone maps (with ONE
worker that includes the arena pages it touched: the daemon never maps the arena), PSS
splits shared pages among their users, RssShmem counts the memfd arena pages a process
has mapped, RssAnon its heap (on CPU its KV cache, and pages still shared copy-on-write
with the zygote). Weights are shared when USS per worker does not grow by the arena and
the sum of PSS is about N x USS + the arena pages touched, not N x the arena.

Device memory comes from nvidia-smi alone (bench.gpu): per process (daemon, zygote,
workers, spares) from --query-compute-apps; the cuda-vmm arena is charged to no process,
so it shows as memory.used less every process's figure, about the arena's bytes once
whatever the number of workers. Before each daemon starts the device's used memory is
read, and after it stops polled until back to that baseline.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import psutil

from preload.bench.checkpoint import weight_bytes
from preload.bench.driver import Daemon, free_port, running_daemon, wait_for
from preload.bench.gpu import BASELINE_SLACK_MIB, Gpu
from preload.bench.results import MiB, begin, finish, mib, row
from preload.options import EngineOptions

SPARE_TIMEOUT = 120.0  # seconds for a spare to reach standby
GPU_MEMORY_UTILIZATION = EngineOptions().gpu_memory_utilization  # the daemons run with the default


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


def host(pid: int) -> dict:
    full = psutil.Process(pid).memory_full_info()
    m = proc_memory(pid)
    return {"pid": pid, "rss": full.rss, "uss": full.uss, "pss": full.pss, "shared": full.shared,
            "anon": m.get("anon", 0), "shmem": m.get("shmem", 0), "file": m.get("file", 0)}


def layout(model: Path, device: str, workers: int, spares: int, gpu: Gpu | None) -> dict:
    """One daemon with `workers` workers and `spares` spares, measured, stopped."""
    before = (gpu.used_mib(), set(gpu.apps())) if gpu else None
    with running_daemon(model, "--device", device, "--workers", workers, "--spare-workers", spares,
                        api_port=free_port()) as d:
        status = wait_for(lambda: standing_by(d.status(), spares), SPARE_TIMEOUT)
        if status is None:
            raise TimeoutError(f"spares not in standby within {SPARE_TIMEOUT:.0f} s: {d.status()['spares']}")
        out = host_memory(d, status)
        if gpu is not None:
            out["gpu"] = device_memory(d, status, gpu)
    if gpu is not None:
        used, waited = gpu.settle_to(before[0])
        out["gpu"] |= {"used_before_start_mib": before[0], "used_after_stop_mib": used,
                       "seconds_to_baseline": round(waited, 3),
                       "returned_to_baseline": used <= before[0] + BASELINE_SLACK_MIB,
                       "pids_left_on_device": sorted(set(gpu.apps()) - before[1])}
    return out


def standing_by(status: dict, spares: int) -> dict | None:
    """`status` once all of the daemon's `spares` spares are in standby, else None."""
    states = [s["state"] for s in status["spares"]]
    return status if states.count("standby") == spares else None


def host_memory(d: Daemon, status: dict) -> dict:
    per = [host(w["pid"]) | {"slot": w["slot"], "kv_cache_bytes": w["kv_cache_bytes"]} for w in status["workers"]]
    spares = [host(s["pid"]) | {"state": s["state"]} for s in status["spares"]]
    dp = psutil.Process(d.pid).memory_full_info()
    return {
        "workers": len(per),
        "spares": len(spares),
        "device": status["device"],
        "arena_bytes": int(sum(status["bytes_per_device"].values())),
        "per_worker": per,
        "per_spare": spares,
        "sum_worker_uss": sum(x["uss"] for x in per),
        "sum_worker_rss": sum(x["rss"] for x in per),
        "sum_worker_pss": sum(x["pss"] for x in per),
        "max_worker_shmem": max(x["shmem"] for x in per),
        "sum_kv_cache_bytes": sum(x["kv_cache_bytes"] for x in per),
        "daemon": {"pid": d.pid, "rss": dp.rss, "uss": dp.uss, "pss": dp.pss},
    }


def device_memory(d: Daemon, status: dict, gpu: Gpu) -> dict:
    """Device memory per process, the device's used and total memory, each worker's KV
    cache (from /status) beside what it holds beyond it (context, workspaces)."""
    roles = {d.pid: "daemon"}
    for c in psutil.Process(d.pid).children():
        if " ".join(c.cmdline()).startswith("preload zygote"):  # its process title
            roles[c.pid] = "zygote"
    workers = {w["pid"]: w for w in status["workers"]}
    roles |= {pid: f"worker {w['slot']}" for pid, w in workers.items()}
    roles |= {s["pid"]: "spare" for s in status["spares"]}
    apps, used = gpu.apps(), gpu.used_mib()
    per_process = [{"pid": pid, "role": roles.get(pid, "other"), "used_mib": m} for pid, m in sorted(apps.items())]
    per_worker = [{"pid": pid, "slot": w["slot"], "used_mib": apps.get(pid), "kv_cache_bytes": w["kv_cache_bytes"],
                   "beyond_kv_mib": None if apps.get(pid) is None else apps[pid] - w["kv_cache_bytes"] / MiB}
                  for pid, w in workers.items()]
    of = lambda role: [p["used_mib"] for p in per_process if p["role"] == role]  # noqa: E731
    return {
        "name": gpu.name,
        "total_mib": gpu.total_mib,
        "used_mib": used,
        "utilization_cap_mib": GPU_MEMORY_UTILIZATION * gpu.total_mib,
        "within_cap": used <= GPU_MEMORY_UTILIZATION * gpu.total_mib,
        "arena_bytes": int(sum(status["bytes_per_device"].values())),
        "daemon_mib": apps.get(d.pid),
        "unattributed_mib": used - sum(m or 0 for m in apps.values()),  # the cuda-vmm arena, charged to no process
        "zygote_on_device": bool(of("zygote")),
        "per_worker": per_worker,
        "spare_mib": of("spare"),
        "other_mib": sum(m or 0 for m in of("other")),
        "per_process": per_process,
        # In a PID namespace other than the driver's, nvidia-smi's pids are not ours.
        "pids_matched": d.pid in apps and all(pid in apps for pid in workers),
    }


def run_memory(models: list[tuple[str, Path]], workers: int = 4, device: str = "auto", progress=lambda msg: None) -> dict:
    t0 = time.perf_counter()
    gpu = Gpu.for_device(device)
    result = begin("memory", device, gpu) | {"memory_workers": workers, "models": []}
    for label, model in models:
        res = {"label": label, "path": str(Path(model).absolute()), "weight_bytes": weight_bytes(model)}
        for n, spares in ((1, 0), (1, 1), (workers, 0)):
            key = f"memory_{n}" + ("+1spare" if spares else "")
            if key not in res:
                progress(f"{label}: {n} worker(s), {spares} spare(s)")
                res[key] = layout(Path(model).absolute(), device, n, spares, gpu)
        result["models"].append(res)
    return finish(result, t0)


def format_table(result: dict) -> str:
    m = result["machine"]
    gpu = f", {m['cuda_device']} ({m['gpu_total_mib']} MiB)" if m.get("cuda_device") else ""
    lines = [f"preload bench memory: {m['hostname']}, {m['cpus_usable']} CPUs{gpu}, torch {m['torch']},"
             f" device {m['device_requested']}, {result['wall_s']:.0f} s in all", "",
             "host memory (MiB; per worker: mean over workers; anon = private heap + KV cache on CPU,"
             " shmem = arena pages mapped; KV = kv_cache_bytes from /status):"]
    widths = (14, 9, 8, 8, 8, 8, 9, 8, 8, 8, 8, 10, 9)
    lines.append(row(("model", "workers", "arena", "KV/wkr", "RSS/wkr", "anon/wkr", "shmem/wkr", "USS/wkr", "PSS/wkr",
                      "sum USS", "sum PSS", "daemon RSS", "spare RSS"), widths))
    for r, key, mem in layouts(result):
        n, ns = mem["workers"], mem["spares"]
        means = [statistics.mean(x[f] for x in mem["per_worker"]) for f in ("kv_cache_bytes", "rss", "anon", "shmem",
                                                                             "uss", "pss")]
        spare_rss = statistics.mean(x["rss"] for x in mem["per_spare"]) if ns else None
        lines.append(row((r["label"], f"{n}" + (f"+{ns}sp" if ns else ""), mib(mem["arena_bytes"]), *map(mib, means),
                          mib(mem["sum_worker_uss"]), mib(mem["sum_worker_pss"]), mib(mem["daemon"]["rss"]),
                          mib(spare_rss)), widths))
    gpu_rows = [(r, key, mem["gpu"]) for r, key, mem in layouts(result) if "gpu" in mem]
    if gpu_rows:
        lines += ["", "device memory (MiB; nvidia-smi; no process = memory.used less every process's figure: the"
                      " cuda-vmm arena; wkr each = min..max over workers; wkr-KV = what a worker holds beyond its KV"
                      " cache: context, workspaces; before/after: memory.used before the daemon started, after it"
                      " stopped):"]
        widths = (14, 9, 8, 7, 10, 13, 8, 7, 6, 6, 7, 10, 7, 7, 10)
        lines.append(row(("model", "workers", "arena", "daemon", "no process", "wkr each", "KV/wkr", "wkr-KV", "spare",
                          "other", "used", f"{GPU_MEMORY_UTILIZATION}xtotal", "total", "before", "after stop"), widths))
        for r, key, g in gpu_rows:
            ws = g["per_worker"]
            used = sorted(w["used_mib"] for w in ws if w["used_mib"] is not None)
            each = "-" if not used else f"{used[0]}" if used[0] == used[-1] else f"{used[0]}..{used[-1]}"
            beyond = [w["beyond_kv_mib"] for w in ws if w["beyond_kv_mib"] is not None]
            n, ns = r[key]["workers"], r[key]["spares"]
            lines.append(row((r["label"], f"{n}" + (f"+{ns}sp" if ns else ""), mib(g["arena_bytes"]),
                              _m(g["daemon_mib"]), _m(g["unattributed_mib"]), each,
                              mib(statistics.mean(w["kv_cache_bytes"] for w in ws)),
                              _m(statistics.mean(beyond) if beyond else None), "/".join(map(_m, g["spare_mib"])) or "-",
                              _m(g["other_mib"]), _m(g["used_mib"]), _m(g["utilization_cap_mib"]), _m(g["total_mib"]),
                              _m(g["used_before_start_mib"]),
                              _m(g["used_after_stop_mib"]) + ("" if g["returned_to_baseline"] else " (!)")), widths))
            if not g["pids_matched"]:
                lines.append(f"  {r['label']} {key}: nvidia-smi's pids are not this PID namespace's: per process"
                             f" figures unmatched ({g['per_process']})")
            if g["zygote_on_device"]:
                lines.append(f"  {r['label']} {key}: the zygote holds device memory")
            if g["pids_left_on_device"]:
                lines.append(f"  {r['label']} {key}: processes left on the device after the stop:"
                             f" {g['pids_left_on_device']}")
    return "\n".join(lines)


def layouts(result: dict):
    """(model, key, measurement) of every daemon measured."""
    return [(r, key, r[key]) for r in result["models"] for key in r if key.startswith("memory_")]


def _m(n: float | None) -> str:  # already MiB
    return "-" if n is None else f"{n:.0f}"
