"""A daemon killed and started again: the keeper's weights re-adopted against a cold start.

One daemon with `--workers 1 --spare-workers 0` on a fresh state dir, started cold; then,
`repeat` times: SIGKILL the daemon and `preload start` the same command again. Timed:
`preload start` launched to exit 0 (daemon ready, every slot's worker ready), the
daemon's own load (its `load_seconds`: the checkpoint read, or the weights taken back
from the keeper), and whether it re-adopted, kept the fingerprint, and took over the
worker the dead daemon left (same pid) instead of starting another. Clients send
completions without a pause through the whole run: every failure is counted, and the
longest gap between two answers is reported.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from preload.bench.checkpoint import weight_bytes
from preload.bench.driver import free_port, start_daemon, stop_everything, wait_for
from preload.bench.results import begin, finish, quantiles, row, sec


class Clients(threading.Thread):
    """Completions one after another on the API port; failures and the longest gap."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.ok, self.failed, self.longest_gap = port, 0, [], 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        last = time.perf_counter()
        with httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60) as client:
            while not self.stop.is_set():
                try:
                    r = client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2, "temperature": 0})
                    if r.status_code != 200:
                        self.failed.append(f"{r.status_code}: {r.text[:200]}")
                        continue
                except httpx.HTTPError as e:
                    self.failed.append(repr(e))
                    continue
                now = time.perf_counter()
                self.ok, self.longest_gap, last = self.ok + 1, max(self.longest_gap, now - last), now


def timed_start(state_dir: Path, model: Path, device: str, api_port: int, health_port: int):
    """The daemon, `preload start`'s time to exit 0, and the seconds from the launch to the
    daemon's imports done (its Daemon object made: two interpreters started and imported)."""
    t, wall = time.perf_counter(), time.time()
    d = start_daemon(state_dir, model, "--device", device, "--workers", 1, "--spare-workers", 0, port=health_port,
                     api_port=api_port)
    exit_s = time.perf_counter() - t
    before = time.time()
    s = d.status()
    stages = {"imports_done_s": before - s["uptime_s"] - wall}
    return d, exit_s, stages


def run_readopt(model: Path, device: str, repeat: int, progress=lambda msg: None) -> dict:
    t0 = time.perf_counter()
    result = begin("readopt", device) | {"model": str(model), "weight_bytes": weight_bytes(model), "repeat": repeat,
                                         "runs": []}
    work = Path(tempfile.mkdtemp(prefix="preload-readopt-"))
    state_dir, api_port, health_port = work / "state", free_port(), free_port()
    clients = None
    try:
        progress("cold start")
        d, exit_s, stages = timed_start(state_dir, model, device, api_port, health_port)
        s = d.status()
        result["cold"] = {"exit_s": exit_s, "load_seconds": s["load_seconds"]} | stages
        fingerprint, worker = s["fingerprint"], s["workers"][0]["pid"]
        clients = Clients(api_port)
        clients.start()
        wait_for(lambda: clients.ok > 3, timeout=60)
        for i in range(repeat):
            progress(f"daemon SIGKILL and start {i + 1}/{repeat}")
            os.kill(d.pid, signal.SIGKILL)
            wait_for(lambda: not psutil.pid_exists(d.pid) or psutil.Process(d.pid).status() == psutil.STATUS_ZOMBIE)
            d, exit_s, stages = timed_start(state_dir, model, device, api_port, health_port)
            s = d.status()
            pids = [w["pid"] for w in s["workers"]]
            result["runs"].append({"exit_s": exit_s, "load_seconds": s["load_seconds"], "readopted": s["readopted"],
                                   "same_fingerprint": s["fingerprint"] == fingerprint, "worker_adopted": pids == [worker]}
                                  | stages)
        clients.stop.set()
        clients.join(60)
        result["requests"] = {"ok": clients.ok, "failed": len(clients.failed), "first_failures": clients.failed[:3],
                              "longest_gap_s": clients.longest_gap}
    finally:
        if clients is not None:
            clients.stop.set()
        stop_everything(state_dir)
        shutil.rmtree(work, ignore_errors=True)
    runs = result["runs"]
    result["readopt_exit_s"] = quantiles(r["exit_s"] for r in runs)
    result["readopt_load_s"] = quantiles(r["load_seconds"] for r in runs)
    result["readopt_imports_done_s"] = quantiles(r["imports_done_s"] for r in runs)
    return finish(result, t0)


def format_table(result: dict) -> str:
    m, runs, req = result["machine"], result["runs"], result["requests"]
    lines = [f"preload bench readopt: {result['model']} ({result['weight_bytes'] / 2**30:.2f} GiB), "
             f"{result['repeat']} daemon SIGKILLs, on {m.get('cpu_model')}; {result['wall_s']:.0f} s", ""]
    widths = (34, 10, 10)
    lines.append(row(("", "start to ready", "load"), widths))
    lines.append(row(("cold start", sec(result["cold"]["exit_s"]), sec(result["cold"]["load_seconds"])), widths))
    lines.append(row(("after SIGKILL, p50", sec(result["readopt_exit_s"]["p50"]), sec(result["readopt_load_s"]["p50"])),
                     widths))
    lines.append(row(("after SIGKILL, max", sec(result["readopt_exit_s"]["max"]), sec(result["readopt_load_s"]["max"])),
                     widths))
    if "readopt_imports_done_s" in result:  # (recorded before it was)
        lines.append(f"after SIGKILL, p50: the daemon's imports done {sec(result['readopt_imports_done_s']['p50'])} s"
                     " after `preload start` began")
    lines += ["", f"re-adopted {sum(r['readopted'] for r in runs)}/{len(runs)}, same fingerprint "
                  f"{sum(r['same_fingerprint'] for r in runs)}/{len(runs)}, worker taken over "
                  f"{sum(r['worker_adopted'] for r in runs)}/{len(runs)}; requests: {req['ok']} answered, "
                  f"{req['failed']} failed, longest gap {req['longest_gap_s']:.3f} s"]
    return "\n".join(lines)
