"""Restart: a worker's death (SIGKILL) or `preload restart` to `/health` 200 again, served
by the NEW worker, against a cold start; with and without the zygote; at two model
sizes; and memory with 1 and with N workers.

Everything runs on this machine in one run, through the real command line:
1. cold start, `cold_repeat` times: launch `preload start --workers 1 --port P` until it
   exits 0 (every worker ready), and until the API port first answers `/health` 200
   (a probe thread polling with short timeouts); the daemon of the last run stays up;
2. on it, `restarts` times each: SIGKILL the worker, and a graceful `preload restart`
   (the `restart` request on the control socket, as the CLI sends it); each timed from
   the kill (or the request) until a `/health` probe on the API port gets 200 from a
   process other than the old worker. Each probe is a fresh connection with a short
   timeout; after a 200 the server side of that very connection is looked up among the
   daemon's children (psutil), so a 200 from a worker that is still draining does not
   count. Between two restarts the bench waits until the old worker is gone and /status
   shows the new one ready;
3. a second daemon with `--no-zygote` (workers are fresh interpreters), SIGKILL again;
4. memory: the daemon with 1 worker, and one with `memory_workers` workers: each
   worker's RSS, USS (private), PSS, shared and RssShmem (pages of the memfd arena it
   has mapped), against the arena's bytes. Weights are shared when a worker's USS is
   its KV cache plus the interpreter, not plus the weights;
5. where the time goes: the daemon's log (death noticed, fork done, worker ready) and
   the worker's own `ready in X s`; and, in a fresh interpreter attached to the daemon,
   the stages a worker runs (imports, attach, model views, KV cache, first token).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from preload.bench.checkpoint import V2_LITE_MINI

from preload.bench.cold import free_port, machine_info, preload_command, proc_memory

MiB = 2**20
PROBE_TIMEOUT = 0.25  # seconds per /health probe; a connection nobody accepts yet waits in the backlog
PROBE_INTERVAL = 0.01
RESTART_TIMEOUT = 120.0
START_TIMEOUT = 600.0
KINDS = ("sigkill", "graceful", "sigkill-no-zygote")

# A tiny DeepSeek-V2-shaped model: stands in for the bundled one when it is not there.
# The V2-Lite family's settings at toy sizes: a stand-in when the bundled model is absent.
TINY = V2_LITE_MINI | {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


# ---- the models ----------------------------------------------------------------------------


def weight_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))


def small_model(work: Path) -> tuple[str, Path]:
    """The bundled model, or (when it has not been trained into the package) a tiny
    random checkpoint of the same family."""
    from preload import BUNDLED_MODEL

    if (Path(BUNDLED_MODEL) / "model.safetensors").exists():
        return "bundled", Path(BUNDLED_MODEL)
    from preload.bench.checkpoint import make_random_checkpoint

    return "tiny-random", make_random_checkpoint(work / "tiny", TINY, seed=0)


def large_model(path: Path) -> tuple[str, Path]:
    """A checkpoint of at least 1 GB, named by its directory: the one at `path`, or
    V2-Lite's real shapes cut to ~1.2 GB (bench.checkpoint.V2_LITE_MINI), made there once."""
    from preload.bench.checkpoint import make_random_checkpoint

    config = path / "config.json"
    if not (config.exists() and weight_bytes(path) > 10**9):
        make_random_checkpoint(path, V2_LITE_MINI, seed=0)
    return path.name, path


# ---- one daemon ------------------------------------------------------------------------------


def _http(port: int, path: str, timeout: float) -> tuple[int, bytes, http.client.HTTPConnection]:
    """GET on a fresh connection, left open (the caller closes it) so that the server
    side of it can still be looked up."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read(), conn
    except BaseException:
        conn.close()
        raise


def _json(port: int, path: str, timeout: float = 10.0) -> dict:
    status, body, conn = _http(port, path, timeout)
    conn.close()
    if status != 200:
        raise RuntimeError(f"GET :{port}{path} -> {status}: {body[:200]!r}")
    return json.loads(body)


@dataclass
class Daemon:
    state_dir: Path
    health_port: int
    api_port: int
    pid: int = 0

    status_errors: int = 0  # /status answers other than 200 (retried; reported, not hidden)

    def status(self) -> dict:
        for attempt in range(5):
            try:
                return _json(self.health_port, "/status")
            except RuntimeError:
                self.status_errors += 1
                if attempt == 4:
                    raise
                time.sleep(0.01)

    def workers(self) -> list[dict]:
        return self.status()["workers"]

    def log(self) -> str:
        try:
            return (self.state_dir / "daemon.log").read_text(errors="replace")
        except OSError:
            return ""

    def worker_log(self, slot: int = 0) -> str:
        try:
            return (self.state_dir / f"worker-{slot}.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        subprocess.run([*preload_command(), "stop", "--state-dir", str(self.state_dir), "--timeout", "60"],
                       capture_output=True, timeout=120)
        if self.pid and psutil.pid_exists(self.pid):
            try:
                p = psutil.Process(self.pid)
                if str(self.state_dir) in " ".join(p.cmdline()):
                    p.kill()
                    p.wait(10)
            except psutil.Error:
                pass
        shutil.rmtree(self.state_dir, ignore_errors=True)


@dataclass
class ColdRun:
    exit_s: float = 0.0  # launch -> `preload start` exits 0 (daemon and every worker ready)
    api_health_s: float | None = None  # launch -> first /health 200 on the API port
    load_seconds: float = 0.0  # the daemon's own figure
    breakdown: dict = field(default_factory=dict)  # from the daemon's log


def start_daemon(model: Path, workers: int, device: str, extra: tuple[str, ...] = ()) -> tuple[Daemon, ColdRun]:
    """`preload start --workers N`, timed to exit 0 and to the API port's first /health 200."""
    d = Daemon(Path(tempfile.mkdtemp(prefix="preload-bench-restart-")), free_port(), free_port())
    cmd = [*preload_command(), "start", "--model", str(model), "--device", device, "--state-dir", str(d.state_dir),
           "--health-port", str(d.health_port), "--workers", str(workers), "--port", str(d.api_port), *extra]
    run = ColdRun()
    stop_probe = threading.Event()

    def probe() -> None:
        while not stop_probe.is_set():
            try:
                status, _, conn = _http(d.api_port, "/health", PROBE_TIMEOUT)
                conn.close()
                if status == 200:
                    run.api_health_s = time.perf_counter() - t0
                    return
            except (OSError, http.client.HTTPException):
                pass
            stop_probe.wait(PROBE_INTERVAL)

    t0 = time.perf_counter()
    wall0 = time.time()
    launcher = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        out, _ = launcher.communicate(timeout=START_TIMEOUT)
        run.exit_s = time.perf_counter() - t0
        if launcher.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {launcher.returncode}: {out.decode(errors='replace')}\n"
                               f"{d.log()[-3000:]}")
        prober.join(30)
        status = d.status()
        d.pid = status["pid"]
        run.load_seconds = float(status["load_seconds"])
        run.breakdown = cold_breakdown(d.log(), wall0, run.load_seconds)
        return d, run
    except BaseException:
        stop_probe.set()
        if launcher.poll() is None:
            launcher.kill()
        d.stop()
        raise
    finally:
        stop_probe.set()


# ---- the daemon's log ------------------------------------------------------------------------

_TS = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
RE_LOADING = re.compile(_TS + r" preload\.daemon INFO loading ")
RE_EXIT = re.compile(_TS + r" preload\.daemon WARNING worker (\d+) \(pid (\d+)\) (.+?); ")
RE_STARTED = re.compile(_TS + r" preload\.daemon INFO worker (\d+) started \(pid (\d+)\)")
RE_READY = re.compile(_TS + r" preload\.daemon INFO worker (\d+) ready \(pid (\d+)\) ([\d.]+) s after start")
RE_WORKER_READY = re.compile(_TS + r" worker-(\d+) INFO ready in ([\d.]+) s")


def _ts(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time, as logging writes it


def cold_breakdown(log: str, launched: float, load_seconds: float) -> dict:
    """launch -> daemon loading (its imports), load, -> first worker forked (zygote's
    imports), -> worker ready; from the daemon's log (ms resolution)."""
    loading = [_ts(m[1]) for m in RE_LOADING.finditer(log)]
    started = [_ts(m[1]) for m in RE_STARTED.finditer(log)]
    ready = [(_ts(m[1]), float(m[4])) for m in RE_READY.finditer(log)]
    if not (loading and started and ready):
        return {}
    return {
        "daemon_imports_s": loading[-1] - launched,
        "load_s": load_seconds,
        "zygote_start_s": started[0] - loading[-1] - load_seconds,
        "worker_start_to_ready_s": ready[0][1],
    }


def restart_breakdown(log: str, worker_log: str, old_pid: int, new_pid: int, t_event: float) -> dict:
    """Where one restart's time went, from the daemon's log and the worker's: the event
    (kill, request) -> the daemon reaps the old worker -> the new one is forked -> it
    reports ready (and its own `ready in`, counted from the top of serve())."""
    out: dict = {}
    for m in RE_EXIT.finditer(log):
        if int(m[3]) == old_pid:
            out["death_noticed_s"] = _ts(m[1]) - t_event
            out["exit"] = m[4]
    started = next((_ts(m[1]) for m in RE_STARTED.finditer(log) if int(m[3]) == new_pid), None)
    if started is not None:
        out["event_to_forked_s"] = started - t_event
    ready = next(((_ts(m[1]), float(m[4])) for m in RE_READY.finditer(log) if int(m[3]) == new_pid), None)
    if ready is not None:
        out["forked_to_ready_s"] = ready[1]
        own = [float(m[3]) for m in RE_WORKER_READY.finditer(worker_log) if _ts(m[1]) <= ready[0] + 0.005]
        if own:
            out["worker_ready_in_s"] = own[-1]
    return out


# ---- one restart -----------------------------------------------------------------------------


def serving_pid(conn: http.client.HTTPConnection, api_port: int, candidates: list[int]) -> int | None:
    """The process holding the server side of `conn` (one of `candidates`)."""
    try:
        local = conn.sock.getsockname()[1]
    except (OSError, AttributeError):
        return None
    for pid in candidates:
        try:
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                if c.laddr and c.raddr and c.laddr.port == api_port and c.raddr.port == local:
                    return pid
        except psutil.Error:
            continue
    return None


def wait_new_worker_healthy(d: Daemon, old: int, t0: float, timeout: float = RESTART_TIMEOUT) -> tuple[float, int, int]:
    """Probe the API port until a /health 200 comes from a process other than `old`:
    (seconds since t0, its pid, probes sent)."""
    probes = 0
    deadline = t0 + timeout
    while time.perf_counter() < deadline:
        probes += 1
        conn = None
        try:
            status, _, conn = _http(d.api_port, "/health", PROBE_TIMEOUT)
            t = time.perf_counter()
            if status == 200:
                pid = serving_pid(conn, d.api_port, [c.pid for c in psutil.Process(d.pid).children()])
                if pid is not None and pid != old:
                    return t - t0, pid, probes
        except (OSError, http.client.HTTPException):
            pass
        finally:
            if conn is not None:
                conn.close()
        time.sleep(PROBE_INTERVAL)
    raise TimeoutError(f"no /health 200 from a new worker within {timeout:.0f} s\n{d.log()[-3000:]}")


def settle(d: Daemon, old: int, new: int, timeout: float = RESTART_TIMEOUT) -> float:
    """Wait until the old worker has exited and been reaped by the daemon (a zombie is
    still on the supervisor's books), and /status shows the new one ready; returns when
    that was seen (perf_counter)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        gone = not psutil.pid_exists(old)
        ws = d.workers()
        if gone and ws[0]["pid"] == new and ws[0]["state"] == "ready":
            return time.perf_counter()
        time.sleep(0.005)
    raise TimeoutError(f"worker {old} -> {new} did not settle: {d.workers()}")


def one_restart(d: Daemon, kind: str) -> dict:
    from preload.ipc.client import DaemonClient

    [w] = d.workers()
    old = w["pid"]
    if kind == "graceful":
        with DaemonClient(d.state_dir, timeout=10) as client:
            wall, t0 = time.time(), time.perf_counter()
            client.request("restart", now=False)
    else:
        wall, t0 = time.time(), time.perf_counter()
        os.kill(old, signal.SIGKILL)
    seconds, new, probes = wait_new_worker_healthy(d, old, t0)
    settled = settle(d, old, new) - t0
    time.sleep(0.05)  # the daemon logs the new worker's ready line right after it says so
    rec = {"kind": kind, "seconds": seconds, "old_pid": old, "new_pid": new, "probes": probes,
           "old_gone_and_status_ready_s": settled}
    rec["breakdown"] = restart_breakdown(d.log(), d.worker_log(), old, new, wall)
    return rec


# ---- memory -------------------------------------------------------------------------------------


def memory(d: Daemon) -> dict:
    status = d.status()
    arena = int(sum(status["bytes_per_device"].values()))
    per = []
    for w in status["workers"]:
        p = psutil.Process(w["pid"])
        full = p.memory_full_info()
        m = proc_memory(w["pid"])
        per.append({"pid": w["pid"], "rss": full.rss, "uss": full.uss, "pss": full.pss, "shared": full.shared,
                    "anon": m.get("anon", 0), "shmem": m.get("shmem", 0), "file": m.get("file", 0)})
    dp = psutil.Process(d.pid).memory_full_info()
    return {
        "workers": len(per),
        "arena_bytes": arena,
        "per_worker": per,
        "sum_worker_uss": sum(x["uss"] for x in per),
        "sum_worker_rss": sum(x["rss"] for x in per),
        "sum_worker_pss": sum(x["pss"] for x in per),
        "max_worker_shmem": max(x["shmem"] for x in per),
        "daemon": {"rss": dp.rss, "uss": dp.uss, "pss": dp.pss},
    }


# ---- inside a worker's start -------------------------------------------------------------------

_STAGES = r"""
import json, sys, time
t = time.perf_counter()
import torch, fastapi, uvicorn  # what the zygote imports
import preload.worker.serve
from preload.worker.attach import attach
from preload.worker.engine import Engine, EngineConfig
from preload.worker.llm import LLM
from preload.worker.model import Transformer
out = {"imports_s": time.perf_counter() - t}
sd = sys.argv[1]
t = time.perf_counter(); a = attach(sd); out["attach_s"] = time.perf_counter() - t; a.close()
t = time.perf_counter(); llm = LLM(state_dir=sd); out["llm_total_s"] = time.perf_counter() - t
t = time.perf_counter(); Transformer(llm.config, llm.attached); out["model_views_s"] = time.perf_counter() - t
kv = []
for _ in range(3):
    t = time.perf_counter(); e = Engine(llm.model, llm.tokenizer, EngineConfig(), llm.device); kv.append(time.perf_counter() - t); del e
out["engine_kv_cache_s"] = sorted(kv)[1]  # median of 3
out["kv_cache_bytes"] = EngineConfig().kv_cache_memory
t = time.perf_counter(); llm.generate([[0]], max_tokens=1, temperature=0.0); out["first_token_s"] = time.perf_counter() - t
t = time.perf_counter(); llm.generate([[0]], max_tokens=1, temperature=0.0); out["second_token_s"] = time.perf_counter() - t
llm.close()
print(json.dumps(out))
"""


def worker_stages(d: Daemon) -> dict:
    """A fresh interpreter attached to the daemon, timing what a worker does at start."""
    r = subprocess.run([sys.executable, "-c", _STAGES, str(d.state_dir)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- the whole benchmark -------------------------------------------------------------------------


def quantiles(values: list[float]) -> dict | None:
    if not values:
        return None
    xs = sorted(values)

    def pick(p: float) -> float:
        k = (len(xs) - 1) * p
        f = int(k)
        return xs[f] + (xs[min(f + 1, len(xs) - 1)] - xs[f]) * (k - f)

    return {"p50": pick(0.5), "p90": pick(0.9), "min": xs[0], "max": xs[-1], "n": len(xs)}


def _median_of(records: list[dict], key: str) -> float | None:
    vals = [r["breakdown"][key] for r in records if key in r.get("breakdown", {})]
    return statistics.median(vals) if vals else None


def bench_model(label: str, model: Path, restarts: int, cold_repeat: int, memory_workers: int, device: str,
                progress) -> dict:
    res: dict = {"label": label, "path": str(model), "weight_bytes": weight_bytes(model), "status_errors": 0}
    # 1. cold starts; the last daemon stays up for the restarts.
    colds: list[ColdRun] = []
    d = None
    for i in range(cold_repeat):
        progress(f"{label}: cold start {i + 1}/{cold_repeat}")
        if d is not None:
            res["status_errors"] += d.status_errors
            d.stop()
        d, run = start_daemon(model, 1, device)
        colds.append(run)
    try:
        res["arena_bytes"] = int(sum(d.status()["bytes_per_device"].values()))
        res["cold"] = {
            "runs": [vars(r) for r in colds],
            "exit_s": quantiles([r.exit_s for r in colds]),
            "api_health_s": quantiles([r.api_health_s for r in colds if r.api_health_s is not None]),
        }
        runs: dict[str, list[dict]] = {}
        for kind in ("sigkill", "graceful"):
            runs[kind] = []
            for i in range(restarts):
                progress(f"{label}: {kind} restart {i + 1}/{restarts}")
                runs[kind].append(one_restart(d, kind))
        progress(f"{label}: memory with 1 worker; worker start stages in a fresh interpreter")
        res["memory_1"] = memory(d)
        res["worker_stages"] = worker_stages(d)
    finally:
        res["status_errors"] += d.status_errors
        d.stop()

    progress(f"{label}: --no-zygote daemon")
    d, nz_cold = start_daemon(model, 1, device, ("--no-zygote",))
    try:
        res["cold_no_zygote"] = vars(nz_cold)
        runs["sigkill-no-zygote"] = []
        for i in range(restarts):
            progress(f"{label}: sigkill-no-zygote restart {i + 1}/{restarts}")
            runs["sigkill-no-zygote"].append(one_restart(d, "sigkill") | {"kind": "sigkill-no-zygote"})
    finally:
        res["status_errors"] += d.status_errors
        d.stop()

    if memory_workers > 1:
        progress(f"{label}: memory with {memory_workers} workers")
        d, _ = start_daemon(model, memory_workers, device)
        try:
            res[f"memory_{memory_workers}"] = memory(d)
        finally:
            res["status_errors"] += d.status_errors
            d.stop()

    cold_p50 = res["cold"]["exit_s"]["p50"]
    api_p50 = res["cold"]["api_health_s"]["p50"] if res["cold"]["api_health_s"] else None
    res["restart"] = {}
    for kind, recs in runs.items():
        q = quantiles([r["seconds"] for r in recs])
        res["restart"][kind] = {
            "runs": recs,
            "seconds": q,
            "ratio_p50_over_cold_exit": q["p50"] / cold_p50,
            "ratio_p50_over_cold_api_health": q["p50"] / api_p50 if api_p50 else None,
            "breakdown_median": {k: _median_of(recs, k) for k in
                                 ("death_noticed_s", "event_to_forked_s", "forked_to_ready_s", "worker_ready_in_s")},
        }
    return res


def run_restart(models: list[tuple[str, Path]], restarts: int = 10, cold_repeat: int = 3, memory_workers: int = 4,
                device: str = "auto", progress=lambda msg: None) -> dict:
    result: dict = {
        "benchmark": "restart",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(device) | {"nproc": len(os.sched_getaffinity(0))},
        "loadavg_before": os.getloadavg(),
        "restarts": restarts,
        "cold_repeat": cold_repeat,
        "memory_workers": memory_workers,
        "probe": {"timeout_s": PROBE_TIMEOUT, "interval_s": PROBE_INTERVAL},
        "models": [],
    }
    for label, model in models:
        result["models"].append(bench_model(label, Path(model).absolute(), restarts, cold_repeat, memory_workers,
                                            device, progress))
    result["loadavg_after"] = os.getloadavg()
    result["notes"] = [
        "cold exit: `preload start --workers 1` launch to exit 0 (it returns once every worker is ready);"
        " cold API 200: launch to the API port's first /health 200.",
        "restart: the SIGKILL (or the `restart` request on the control socket, as `preload restart` sends it) to"
        " the first /health 200 on the API port from a process other than the old worker (the server side of the"
        " probe's connection is looked up with psutil). Probes: fresh connections, timeout"
        f" {PROBE_TIMEOUT} s, every {PROBE_INTERVAL} s.",
        "graceful: the replacement is forked and must be ready before the old worker is told to drain; the clock"
        " stops at the new worker's first 200, old_gone_and_status_ready_s when the old one has also exited.",
        "breakdown (daemon log, ms resolution): death_noticed = kill -> daemon reaps the old worker;"
        " event_to_forked = kill/request -> the new worker is forked; forked_to_ready = fork -> the worker reports"
        " ready (daemon's figure); worker_ready_in = the worker's own figure from the top of serve()"
        " (attach, engine, HTTP server, a warm-up token).",
        "memory: USS counts pages mapped by this process alone (with ONE worker that includes the arena pages it"
        " has touched, since the daemon never maps the arena); PSS splits shared pages among their users; shmem"
        " (RssShmem) counts the arena pages a worker has mapped; anon (RssAnon) is its heap: its own KV cache"
        " (--kv-cache-memory, 512 MiB by default) plus pages still shared copy-on-write with the zygote. Weights are"
        " shared when, with N workers, USS/wkr does not include shmem/wkr and sum PSS is about N x USS/wkr + the"
        " arena pages touched, not N x the arena.",
    ]
    return result


# ---- the table -----------------------------------------------------------------------------------


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _mib(n: int | float) -> str:
    return f"{n / MiB:.1f}"


def _row(cells, widths) -> str:
    return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"preload bench restart: {result['restarts']} restarts of each kind, {result['cold_repeat']} cold starts",
        f"machine: {m['hostname']}, nproc {m['nproc']} ({m.get('cpu_model') or '?'}), torch {m['torch']},"
        f" load avg before {result['loadavg_before'][0]:.2f}, after {result['loadavg_after'][0]:.2f}",
        "",
    ]
    head = ("model", "weights MiB", "kind", "p50 s", "p90 s", "min s", "max s", "/cold exit", "/cold API")
    widths = (14, 11, 17, 7, 7, 7, 7, 10, 9)
    lines.append(_row(head, widths))
    for r in result["models"]:
        c = r["cold"]
        lines.append(_row((r["label"], _mib(r["weight_bytes"]), "cold: start exit", _s(c["exit_s"]["p50"]),
                           _s(c["exit_s"]["p90"]), _s(c["exit_s"]["min"]), _s(c["exit_s"]["max"]), "", ""), widths))
        if c["api_health_s"]:
            q = c["api_health_s"]
            lines.append(_row(("", "", "cold: API 200", _s(q["p50"]), _s(q["p90"]), _s(q["min"]), _s(q["max"]), "", ""),
                              widths))
        nz = r["cold_no_zygote"]
        lines.append(_row(("", "", "cold, no zygote", _s(nz["exit_s"]), "", "", "", "", ""), widths))
        for kind, k in r["restart"].items():
            q = k["seconds"]
            api = k["ratio_p50_over_cold_api_health"]
            lines.append(_row(("", "", kind, _s(q["p50"]), _s(q["p90"]), _s(q["min"]), _s(q["max"]),
                               f"{k['ratio_p50_over_cold_exit']:.3f}", "-" if api is None else f"{api:.3f}"), widths))
    lines += ["", "where a restart's time goes (medians, seconds; from the daemon's and the worker's logs):"]
    head = ("model", "kind", "total", "->reaped", "->forked", "fork->ready", "worker's own", "ready->200")
    widths = (14, 17, 7, 8, 8, 11, 12, 10)
    lines.append(_row(head, widths))
    for r in result["models"]:
        for kind, k in r["restart"].items():
            b = k["breakdown_median"]
            total = k["seconds"]["p50"]
            rest = None
            if b["event_to_forked_s"] is not None and b["forked_to_ready_s"] is not None:
                rest = total - b["event_to_forked_s"] - b["forked_to_ready_s"]
            lines.append(_row((r["label"], kind, _s(total), _s(b["death_noticed_s"]), _s(b["event_to_forked_s"]),
                               _s(b["forked_to_ready_s"]), _s(b["worker_ready_in_s"]), _s(rest)), widths))
    lines += ["", "a worker's start, stage by stage, in a fresh interpreter attached to the daemon (seconds):"]
    head = ("model", "imports", "attach", "LLM()", "views", "KV cache", "1st token", "2nd token")
    widths = (14, 8, 7, 7, 7, 9, 9, 9)
    lines.append(_row(head, widths))
    for r in result["models"]:
        st = r.get("worker_stages", {})
        if "error" in st:
            lines.append(f"{r['label']}: {st['error'].splitlines()[-1] if st['error'] else 'failed'}")
            continue
        lines.append(_row((r["label"], _s(st.get("imports_s")), _s(st.get("attach_s")), _s(st.get("llm_total_s")),
                           _s(st.get("model_views_s")), _s(st.get("engine_kv_cache_s")), _s(st.get("first_token_s")),
                           _s(st.get("second_token_s"))), widths))
    lines += ["", "cold start, where it goes (median run; seconds): daemon imports, load, zygote start, worker fork->ready"]
    for r in result["models"]:
        bs = [x["breakdown"] for x in r["cold"]["runs"] if x["breakdown"]]
        if bs:
            med = {k: statistics.median(b[k] for b in bs) for k in bs[0]}
            lines.append(f"  {r['label']}: " + ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in med.items()))
    lines += ["", "memory (MiB; per worker: mean over workers; anon = private heap + KV cache, shmem = arena pages mapped):"]
    head = ("model", "workers", "arena", "RSS/wkr", "anon/wkr", "shmem/wkr", "USS/wkr", "PSS/wkr", "sum USS", "sum PSS",
            "daemon RSS")
    widths = (14, 7, 8, 8, 8, 9, 8, 8, 8, 8, 10)
    lines.append(_row(head, widths))
    for r in result["models"]:
        for key in sorted(k for k in r if k.startswith("memory_")):
            mem = r[key]
            n = mem["workers"]
            mean = lambda f: sum(x[f] for x in mem["per_worker"]) / n  # noqa: E731
            lines.append(_row((r["label"], n, _mib(mem["arena_bytes"]), _mib(mean("rss")), _mib(mean("anon")),
                               _mib(mean("shmem")), _mib(mean("uss")), _mib(mean("pss")), _mib(mem["sum_worker_uss"]),
                               _mib(mem["sum_worker_pss"]), _mib(mem["daemon"]["rss"])), widths))
    errors = {r["label"]: r.get("status_errors", 0) for r in result["models"]}
    if any(errors.values()):
        lines += ["", f"daemon /status answered non-200 (retried) this many times: {errors}"]
    lines += ["", *("- " + n for n in result["notes"])]
    return "\n".join(lines)
