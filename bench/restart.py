"""Restart: a worker's death (SIGKILL) or `preload restart` to `/health` 200 again, served
by the NEW worker, against a cold start; a warm spare taking over, a fresh fork from the
zygote, a graceful restart and a fresh interpreter without the zygote; at two model sizes;
and memory (host, and device memory on CUDA) with 1 and with N workers.

Everything runs on this machine in one run, through the real command line, and every
daemon is started with an explicit `--spare-workers` (its default differs between CPU and
GPU), so that CPU and GPU runs measure the same thing:
1. cold start, `cold_repeat` times: launch `preload start --workers 1 --spare-workers 0
   --port P` until it exits 0 (every worker ready), and until the API port first answers
   `/health` 200 (a probe thread polling with short timeouts); the daemon of the last run
   stays up;
2. on it, `restarts` times each: `sigkill` (SIGKILL the worker; the supervisor forks a
   fresh one from the zygote) and `graceful` (the `restart` request on the control
   socket, as `preload restart` sends it); each timed from the kill (or the request)
   until a `/health` probe on the API port gets 200 from a process other than the old
   worker. Each probe is a fresh connection with a short timeout; after a 200 the server
   side of that very connection is looked up among the daemon's children (psutil), so a
   200 from a worker that is still draining does not count. Between two restarts the
   bench waits until the old worker is gone and /status shows the new one ready;
3. `sigkill-spare`: a daemon with `--spare-workers 1`; before each kill the bench waits
   until /status shows the spare in state `standby` (attached, warmed up, waiting), so
   that every kill measures a warm spare taking over the slot (daemon log: `spare (pid P,
   standby) takes slot 0`); then SIGKILL the worker, timed as above; the time until the
   next spare is in standby again is recorded too;
4. `sigkill-no-zygote`: a daemon with `--no-zygote --spare-workers 0` (workers are fresh
   interpreters), SIGKILL again;
5. memory, with 1 worker (the daemon of 1. and 2.) and with `memory_workers` workers (a
   daemon of its own), both `--spare-workers 0` so that the figures are about N workers
   (the spare daemon of 3. is measured as well, as `memory_1+1spare`): per worker its
   RSS, USS (private), PSS, shared and RssShmem (pages of the memfd arena it has mapped),
   and its `kv_cache_bytes` from /status, against the arena's bytes. On CUDA, device
   memory too, from nvidia-smi only (the bench process never creates a CUDA context):
   per process (daemon, zygote, each worker, spares) from `--query-compute-apps`, the
   device's used and total memory, and the device's used memory before the daemon
   started and after it stopped (it must return to that baseline);
6. where the time goes: the daemon's log (death noticed, fork done or spare promoted,
   worker ready) and the worker's own `ready in X s`; and, in a fresh interpreter
   attached to the daemon, the stages a worker runs (imports, attach, model views, KV
   cache, first token).
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
from preload.bench.cold import free_port, host_info, preload_command, proc_memory

MiB = 2**20
PROBE_TIMEOUT = 0.25  # seconds per /health probe; a connection nobody accepts yet waits in the backlog
PROBE_INTERVAL = 0.01
RESTART_TIMEOUT = 120.0
SPARE_TIMEOUT = 120.0  # for a spare to reach standby
START_TIMEOUT = 600.0
GPU_SETTLE_TIMEOUT = 30.0  # for the device's used memory to return to its baseline after a daemon stops
GPU_BASELINE_SLACK_MIB = 16  # memory.used jitters by a few MiB
GPU_MEMORY_UTILIZATION = 0.9  # `preload start --gpu-memory-utilization`, left at its default
KINDS = ("sigkill-spare", "sigkill", "graceful", "sigkill-no-zygote")
BREAKDOWN_KEYS = ("death_noticed_s", "event_to_forked_s", "event_to_promoted_s", "forked_to_ready_s",
                  "promoted_to_ready_s", "go_to_ready_s", "worker_ready_in_s", "old_exit_s", "next_spare_standby_s")

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


# ---- the GPU, through nvidia-smi only ----------------------------------------------------------


def _smi(*args: str) -> list[list[str]]:
    r = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"nvidia-smi {' '.join(args)} exited {r.returncode}: {(r.stderr or r.stdout).strip()}")
    return [[c.strip() for c in line.split(",")] for line in r.stdout.splitlines() if line.strip()]


def _mib_or_none(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


@dataclass
class Gpu:
    """The device the daemons run on, as nvidia-smi sees it. The bench never touches CUDA
    itself: a context in this process would take device memory and show up in the figures."""

    select: str  # nvidia-smi -i: a physical index or a UUID (CUDA_VISIBLE_DEVICES maps the logical one)
    uuid: str
    name: str
    total_mib: int

    @classmethod
    def for_device(cls, device: str) -> Gpu | None:
        if not (device.startswith("cuda") or device == "auto"):
            return None
        if shutil.which("nvidia-smi") is None:
            if device.startswith("cuda"):
                raise RuntimeError(f"--device {device}: device memory is read with nvidia-smi, which is not on PATH")
            return None
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        visible = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
        select = visible[index] if visible else str(index)
        try:
            [[uuid, name, _used, total]] = _smi("--query-gpu=uuid,name,memory.used,memory.total", "-i", select)
        except (RuntimeError, ValueError, OSError):
            if device == "auto":
                return None
            raise
        return cls(select, uuid, name, int(float(total)))

    def used_mib(self) -> int:
        [[used]] = _smi("--query-gpu=memory.used", "-i", self.select)
        return int(float(used))

    def apps(self) -> dict[int, int | None]:
        """MiB of device memory per process with a context on this device."""
        out: dict[int, int | None] = {}
        for row in _smi("--query-compute-apps=pid,used_memory,gpu_uuid"):
            if len(row) >= 3 and row[2] == self.uuid:
                out[int(row[0])] = _mib_or_none(row[1])
        return out

    def settle_to(self, baseline: int, timeout: float = GPU_SETTLE_TIMEOUT) -> tuple[int, float]:
        """Poll until the device's used memory is back to `baseline` (within a few MiB):
        (the last reading, seconds waited)."""
        t0 = time.perf_counter()
        while True:
            used = self.used_mib()
            waited = time.perf_counter() - t0
            if used <= baseline + GPU_BASELINE_SLACK_MIB or waited > timeout:
                return used, waited
            time.sleep(0.25)


def machine_info(device: str, gpu: Gpu | None) -> dict:
    """bench.cold's host_info; the GPU's name comes from nvidia-smi, so that this process
    never initializes CUDA."""
    info = host_info(device) | {"nproc": len(os.sched_getaffinity(0))}
    if gpu is not None:
        info |= {"cuda_device": gpu.name, "gpu_uuid": gpu.uuid, "gpu_total_mib": gpu.total_mib,
                 "nvidia_smi_index": gpu.select}
    return info


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
    spares: int = 0  # --spare-workers
    pid: int = 0
    gpu: Gpu | None = None
    device_used_before_mib: int | None = None  # the device's used memory just before `preload start`
    device_pids_before: set = field(default_factory=set)  # processes on the device then
    device_after_stop: dict | None = None  # filled by stop()

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
        if self.gpu is not None and self.device_used_before_mib is not None and self.device_after_stop is None:
            used, waited = self.gpu.settle_to(self.device_used_before_mib)
            left = sorted(set(self.gpu.apps()) - self.device_pids_before)  # ours, still holding device memory
            self.device_after_stop = {
                "used_before_start_mib": self.device_used_before_mib,
                "used_after_stop_mib": used,
                "seconds_to_baseline": round(waited, 3),
                "returned_to_baseline": used <= self.device_used_before_mib + GPU_BASELINE_SLACK_MIB,
                "pids_left_on_device": left,
            }


@dataclass
class ColdRun:
    exit_s: float = 0.0  # launch -> `preload start` exits 0 (daemon and every worker ready)
    api_health_s: float | None = None  # launch -> first /health 200 on the API port
    load_seconds: float = 0.0  # the daemon's own figure
    breakdown: dict = field(default_factory=dict)  # from the daemon's log


def start_daemon(model: Path, workers: int, device: str, spares: int, extra: tuple[str, ...] = (),
                 gpu: Gpu | None = None) -> tuple[Daemon, ColdRun]:
    """`preload start --workers N --spare-workers K`, timed to exit 0 and to the API
    port's first /health 200. On a GPU the device's used memory is read first."""
    d = Daemon(Path(tempfile.mkdtemp(prefix="preload-bench-restart-")), free_port(), free_port(), spares, gpu=gpu)
    if gpu is not None:
        d.device_pids_before = set(gpu.apps())
        d.device_used_before_mib = gpu.used_mib()
    cmd = [*preload_command(), "start", "--model", str(model), "--device", device, "--state-dir", str(d.state_dir),
           "--health-port", str(d.health_port), "--workers", str(workers), "--spare-workers", str(spares),
           "--port", str(d.api_port), *extra]
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
RE_SPARE_STARTED = re.compile(_TS + r" preload\.daemon INFO spare started \(pid (\d+)\)")
RE_PROMOTED = re.compile(_TS + r" preload\.daemon INFO spare \(pid (\d+), (\w+)\) takes slot (\d+)")
RE_NO_ROOM = re.compile(_TS + r" preload\.daemon INFO no room for a second KV cache: worker (\d+) drains")
RE_ZYGOTE_RENEW = re.compile(_TS + r" preload\.daemon INFO installed code changed; renewing the zygote")
RE_ZYGOTE_RENEWED = re.compile(_TS + r" preload\.daemon INFO zygote renewed \(pid \d+\)")
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
    """Where one restart's time went, from the daemon's log and the worker's (timestamps
    at ms resolution): the event (kill, request) -> the daemon reaps the old worker ->
    a new one is forked, or a spare takes the slot -> it reports ready (and the worker's
    own `ready in`, counted from the top of serve(); only for a worker forked for the slot,
    since a spare counts from its own start, long before)."""
    out: dict = {}
    for m in RE_EXIT.finditer(log):
        if int(m[3]) == old_pid:
            out["death_noticed_s"] = _ts(m[1]) - t_event
            out["exit"] = m[4]
    started = next((_ts(m[1]) for m in RE_STARTED.finditer(log) if int(m[3]) == new_pid), None)
    promoted = next((m for m in RE_PROMOTED.finditer(log) if int(m[2]) == new_pid), None)
    ready = next(((_ts(m[1]), float(m[4])) for m in RE_READY.finditer(log) if int(m[3]) == new_pid), None)
    out["drained_first"] = any(_ts(m[1]) >= t_event - 0.001 for m in RE_NO_ROOM.finditer(log))
    # The installed code changed (files edited meanwhile): the zygote was renewed, seconds of imports.
    end = ready[0] if ready is not None else float("inf")
    begun = [_ts(m[1]) for m in RE_ZYGOTE_RENEW.finditer(log)]
    done = [_ts(m[1]) for m in RE_ZYGOTE_RENEWED.finditer(log)]
    out["zygote_renewed"] = any(b <= end and next((e for e in done if e >= b), float("inf")) >= t_event for b in begun)
    if promoted is not None:
        out["promoted_from"] = promoted[3]  # the spare's state when it took the slot: standby or warming
        out["event_to_promoted_s"] = _ts(promoted[1]) - t_event
        if ready is not None:
            out["promoted_to_ready_s"] = ready[0] - _ts(promoted[1])
    elif started is not None:
        out["event_to_forked_s"] = started - t_event
        if ready is not None:
            out["forked_to_ready_s"] = ready[0] - started
    if ready is not None:
        out["go_to_ready_s"] = ready[1]  # the daemon's figure: from the slot given (go) to ready
        if promoted is None:
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


def _exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class ExitWatch(threading.Thread):
    """Notes when a process exits (a zombie counts), polling every 2 ms: seconds since t0."""

    def __init__(self, pid: int, t0: float, timeout: float = RESTART_TIMEOUT):
        super().__init__(daemon=True)
        self.pid, self.t0, self.timeout, self.seconds = pid, t0, timeout, None
        self.start()

    def run(self) -> None:
        while time.perf_counter() - self.t0 < self.timeout:
            if _exited(self.pid):
                self.seconds = time.perf_counter() - self.t0
                return
            time.sleep(0.002)


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


def settle(d: Daemon, old: int, new: int, timeout: float = RESTART_TIMEOUT) -> tuple[float, dict]:
    """Wait until the old worker has exited and been reaped by the daemon (a zombie is
    still on the supervisor's books), and /status shows the new one ready; returns when
    that was seen (perf_counter) and the new worker's /status entry."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        gone = not psutil.pid_exists(old)
        ws = d.workers()
        if gone and ws[0]["pid"] == new and ws[0]["state"] == "ready":
            return time.perf_counter(), ws[0]
        time.sleep(0.005)
    raise TimeoutError(f"worker {old} -> {new} did not settle: {d.workers()}")


def wait_standby_spare(d: Daemon, not_pids: tuple[int, ...] = (), timeout: float = SPARE_TIMEOUT) -> dict:
    """Wait until /status shows a spare (other than `not_pids`) in state standby."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        status = d.status()
        for s in status.get("spares", []):
            if s["state"] == "standby" and s["pid"] not in not_pids:
                return s
        time.sleep(0.02)
    raise TimeoutError(f"no spare in standby within {timeout:.0f} s: {d.status().get('spares')}\n{d.log()[-3000:]}")


def one_restart(d: Daemon, kind: str) -> dict:
    from preload.ipc.client import DaemonClient

    spare = wait_standby_spare(d) if kind == "sigkill-spare" else None
    [w] = d.workers()
    old = w["pid"]
    if kind == "graceful":
        with DaemonClient(d.state_dir, timeout=10) as client:
            wall, t0 = time.time(), time.perf_counter()
            watch = ExitWatch(old, t0)
            client.request("restart", now=False)
    else:
        wall, t0 = time.time(), time.perf_counter()
        os.kill(old, signal.SIGKILL)
        watch = ExitWatch(old, t0)
    seconds, new, probes = wait_new_worker_healthy(d, old, t0)
    settled, entry = settle(d, old, new)
    watch.join(1)
    rec = {"kind": kind, "seconds": seconds, "old_pid": old, "new_pid": new, "probes": probes,
           "old_gone_and_status_ready_s": settled - t0,
           "old_kv_cache_bytes": w.get("kv_cache_bytes"), "new_kv_cache_bytes": entry.get("kv_cache_bytes")}
    if spare is not None:
        rec["spare_pid"] = spare["pid"]
        rec["spare_standby_for_s"] = spare["uptime_s"]  # its age when killed: forked that long before
        rec["promoted"] = new == spare["pid"]
        nxt = wait_standby_spare(d, not_pids=(old, new, spare["pid"]))
        rec["next_spare_pid"] = nxt["pid"]
        next_standby = time.perf_counter() - t0
    time.sleep(0.05)  # the daemon logs the new worker's ready line right after it says so
    rec["breakdown"] = restart_breakdown(d.log(), d.worker_log(), old, new, wall)
    if watch.seconds is not None:
        rec["breakdown"]["old_exit_s"] = watch.seconds
    if spare is not None:
        rec["breakdown"]["next_spare_standby_s"] = next_standby
    return rec


# ---- memory -------------------------------------------------------------------------------------


def _host(pid: int) -> dict:
    p = psutil.Process(pid)
    full = p.memory_full_info()
    m = proc_memory(pid)
    return {"pid": pid, "rss": full.rss, "uss": full.uss, "pss": full.pss, "shared": full.shared,
            "anon": m.get("anon", 0), "shmem": m.get("shmem", 0), "file": m.get("file", 0)}


def memory(d: Daemon) -> dict:
    status = d.status()
    arena = int(sum(status["bytes_per_device"].values()))
    per = [_host(w["pid"]) | {"slot": w["slot"], "kv_cache_bytes": w.get("kv_cache_bytes", 0)} for w in status["workers"]]
    spares = [_host(s["pid"]) | {"state": s["state"]} for s in status.get("spares", [])]
    dp = psutil.Process(d.pid).memory_full_info()
    out = {
        "workers": len(per),
        "spares": len(spares),
        "device": status.get("device"),
        "arena_bytes": arena,
        "per_worker": per,
        "per_spare": spares,
        "sum_worker_uss": sum(x["uss"] for x in per),
        "sum_worker_rss": sum(x["rss"] for x in per),
        "sum_worker_pss": sum(x["pss"] for x in per),
        "max_worker_shmem": max(x["shmem"] for x in per),
        "sum_kv_cache_bytes": sum(x["kv_cache_bytes"] for x in per),
        "daemon": {"pid": d.pid, "rss": dp.rss, "uss": dp.uss, "pss": dp.pss},
    }
    if d.gpu is not None:
        out["gpu"] = device_memory(d, status, d.gpu)
    return out


def device_memory(d: Daemon, status: dict, gpu: Gpu) -> dict:
    """Device memory per process (nvidia-smi --query-compute-apps), the device's used and
    total memory, each worker's KV cache (from /status) and the arena (weights)."""
    roles = {d.pid: "daemon"}
    try:
        for c in psutil.Process(d.pid).children():
            if "preload.preloadd.zygote" in " ".join(c.cmdline()):
                roles[c.pid] = "zygote"
    except psutil.Error:
        pass
    workers = {w["pid"]: w for w in status["workers"]}
    roles |= {pid: f"worker {w['slot']}" for pid, w in workers.items()}
    roles |= {s["pid"]: "spare" for s in status.get("spares", [])}
    apps = gpu.apps()
    used = gpu.used_mib()
    arena = int(sum(status["bytes_per_device"].values()))
    per_process = [{"pid": pid, "role": roles.get(pid, "other"), "used_mib": mib} for pid, mib in sorted(apps.items())]
    per_worker = []
    for pid, w in workers.items():
        mib = apps.get(pid)
        kv = w.get("kv_cache_bytes", 0)
        per_worker.append({"pid": pid, "slot": w["slot"], "used_mib": mib, "kv_cache_bytes": kv,
                           "beyond_kv_mib": None if mib is None else mib - kv / MiB})
    known = lambda role: [p["used_mib"] for p in per_process if p["role"] == role]  # noqa: E731
    return {
        "name": gpu.name,
        "total_mib": gpu.total_mib,
        "used_mib": used,
        "utilization_cap_mib": GPU_MEMORY_UTILIZATION * gpu.total_mib,
        "within_cap": used <= GPU_MEMORY_UTILIZATION * gpu.total_mib,
        "arena_bytes": arena,
        "daemon_mib": apps.get(d.pid),
        # cuda-vmm memory (cuMemCreate, shared through fds) is charged to no process by nvidia-smi: the arena
        # shows up here, in memory.used beyond the processes' sum, once however many workers map it.
        "unattributed_mib": used - sum(m or 0 for m in apps.values()),
        "zygote_on_device": bool(known("zygote")),
        "per_worker": per_worker,
        "spare_mib": known("spare"),
        "other_mib": sum(m or 0 for m in known("other")),
        "per_process": per_process,
        # In a PID namespace other than the driver's, nvidia-smi's pids are not ours.
        "pids_matched": d.pid in apps and all(pid in apps for pid in workers),
    }


# ---- inside a worker's start -------------------------------------------------------------------

_STAGES = r"""
import json, sys, time
t = time.perf_counter()
import torch, fastapi, uvicorn  # what the zygote imports
import preload.worker.serve
from preload.worker.attach import attach
from preload.worker.engine.engine import Engine, EngineConfig
from preload.worker.llm import LLM
from preload.worker.model.deepseek import Transformer
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


def _stop(d: Daemon, res: dict, memory_key: str | None = None) -> None:
    """Stop a daemon; on a GPU, record whether the device went back to its baseline."""
    res["status_errors"] += d.status_errors
    d.stop()
    if d.device_after_stop is not None:
        res.setdefault("gpu_baseline", []).append({"daemon": memory_key or "", **d.device_after_stop})
        if memory_key and memory_key in res and "gpu" in res[memory_key]:
            res[memory_key]["gpu"] |= d.device_after_stop


def bench_model(label: str, model: Path, restarts: int, cold_repeat: int, memory_workers: int, device: str,
                gpu: Gpu | None, progress) -> dict:
    res: dict = {"label": label, "path": str(model), "weight_bytes": weight_bytes(model), "status_errors": 0,
                 "phase_s": {}}
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    clock = [time.perf_counter()]

    def phase(name: str) -> None:  # wall seconds of each part of the run, to plan the next one
        now = time.perf_counter()
        res["phase_s"][name] = round(now - clock[0], 3)
        clock[0] = now

    def restart_series(d: Daemon, kind: str) -> None:
        for i in range(restarts):
            progress(f"{label}: {kind} restart {i + 1}/{restarts}")
            runs[kind].append(one_restart(d, kind))

    # 1. cold starts (no spare); the last daemon stays up for sigkill and graceful, then memory with 1 worker.
    colds: list[ColdRun] = []
    d = None
    for i in range(cold_repeat):
        progress(f"{label}: cold start {i + 1}/{cold_repeat}")
        if d is not None:
            _stop(d, res, "cold")
        d, run = start_daemon(model, 1, device, 0, gpu=gpu)
        colds.append(run)
    try:
        res["arena_bytes"] = int(sum(d.status()["bytes_per_device"].values()))
        res["cold"] = {
            "runs": [vars(r) for r in colds],
            "exit_s": quantiles([r.exit_s for r in colds]),
            "api_health_s": quantiles([r.api_health_s for r in colds if r.api_health_s is not None]),
        }
        restart_series(d, "sigkill")
        restart_series(d, "graceful")
        progress(f"{label}: memory with 1 worker; worker start stages in a fresh interpreter")
        res["memory_1"] = memory(d)
        res["worker_stages"] = worker_stages(d)
    finally:
        _stop(d, res, "memory_1")
    phase("cold, sigkill, graceful, memory_1, stages")

    # 2. a warm spare takes the slot.
    progress(f"{label}: --spare-workers 1 daemon")
    d, spare_cold = start_daemon(model, 1, device, 1, gpu=gpu)
    try:
        res["cold_spare"] = vars(spare_cold)
        restart_series(d, "sigkill-spare")
        wait_standby_spare(d)
        res["memory_1+1spare"] = memory(d)
    finally:
        _stop(d, res, "memory_1+1spare")
    phase("sigkill-spare")

    # 3. no zygote: every worker is a fresh interpreter.
    progress(f"{label}: --no-zygote daemon")
    d, nz_cold = start_daemon(model, 1, device, 0, ("--no-zygote",), gpu=gpu)
    try:
        res["cold_no_zygote"] = vars(nz_cold)
        restart_series(d, "sigkill-no-zygote")
    finally:
        _stop(d, res, "no_zygote")
    phase("sigkill-no-zygote")

    if memory_workers > 1:
        progress(f"{label}: memory with {memory_workers} workers")
        d, _ = start_daemon(model, memory_workers, device, 0, gpu=gpu)
        key = f"memory_{memory_workers}"
        try:
            res[key] = memory(d)
        finally:
            _stop(d, res, key)
        phase(key)

    cold_p50 = res["cold"]["exit_s"]["p50"]
    api_p50 = res["cold"]["api_health_s"]["p50"] if res["cold"]["api_health_s"] else None
    res["restart"] = {}
    for kind in KINDS:
        recs = runs[kind]
        q = quantiles([r["seconds"] for r in recs])
        summary = {
            "runs": recs,
            "seconds": q,
            "ratio_p50_over_cold_exit": q["p50"] / cold_p50,
            "ratio_p50_over_cold_api_health": q["p50"] / api_p50 if api_p50 else None,
            "breakdown_median": {k: _median_of(recs, k) for k in BREAKDOWN_KEYS},
            "kv_cache_changed": sum(r["new_kv_cache_bytes"] != r["old_kv_cache_bytes"] for r in recs),
            "zygote_renewed": sum(bool(r["breakdown"].get("zygote_renewed")) for r in recs),
        }
        if kind == "sigkill-spare":
            summary["promoted"] = sum(bool(r.get("promoted")) for r in recs)
            summary["promoted_from_standby"] = sum(r["breakdown"].get("promoted_from") == "standby" for r in recs)
        if kind == "graceful":
            summary["drained_first"] = sum(bool(r["breakdown"].get("drained_first")) for r in recs)
        res["restart"][kind] = summary
    return res


def run_restart(models: list[tuple[str, Path]], restarts: int = 10, cold_repeat: int = 3, memory_workers: int = 4,
                device: str = "auto", progress=lambda msg: None) -> dict:
    gpu = Gpu.for_device(device)
    result: dict = {
        "benchmark": "restart",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(device, gpu),
        "loadavg_before": os.getloadavg(),
        "restarts": restarts,
        "cold_repeat": cold_repeat,
        "memory_workers": memory_workers,
        "kinds": list(KINDS),
        "probe": {"timeout_s": PROBE_TIMEOUT, "interval_s": PROBE_INTERVAL},
        "gpu_used_at_start_mib": gpu.used_mib() if gpu else None,
        "models": [],
    }
    t0 = time.perf_counter()
    for label, model in models:
        result["models"].append(bench_model(label, Path(model).absolute(), restarts, cold_repeat, memory_workers,
                                            device, gpu, progress))
    result["wall_s"] = time.perf_counter() - t0
    result["loadavg_after"] = os.getloadavg()
    result["notes"] = notes(memory_workers)
    return result


def notes(memory_workers: int) -> list[str]:
    """What the figures mean, written into the JSON and under the table."""
    return [
        "every daemon is started with an explicit --spare-workers (default: 1 on a GPU, 0 on CPU), so CPU and GPU"
        " runs measure the same thing. cold exit: `preload start --workers 1 --spare-workers 0` launch to exit 0 (it"
        " returns once every worker is ready); cold API 200: launch to the API port's first /health 200; 'cold, 1"
        " spare' and 'cold, no zygote' are the single starts of those daemons.",
        "restart: the SIGKILL (or the `restart` request on the control socket, as `preload restart` sends it) to"
        " the first /health 200 on the API port from a process other than the old worker (the server side of the"
        " probe's connection is looked up with psutil). Probes: fresh connections, timeout"
        f" {PROBE_TIMEOUT} s, every {PROBE_INTERVAL} s. Between two restarts: old worker reaped, new one ready.",
        "sigkill-spare: --spare-workers 1; before each kill /status shows the spare in standby (attached, one warm-up"
        " token on a tiny KV cache, waiting on its go pipe), so each kill measures a warm spare taking the slot: it"
        " then allocates its real KV cache and accepts on the shared socket. promoted = the new worker is that"
        " spare; next_spare_standby = kill -> the next spare (forked once the slot's worker is ready) in standby.",
        "sigkill: --spare-workers 0, a fresh fork from the zygote; sigkill-no-zygote: --no-zygote --spare-workers 0,"
        " a fresh interpreter.",
        "graceful: --spare-workers 0; the replacement is forked and warms up; it takes the slot before the old"
        " worker drains when the device has room for both KV caches, else (drained_first, the rule on a GPU whose"
        " worker holds its auto KV share) right after the old one has drained and exited. The clock stops at the new"
        " worker's first 200; old_exit = when the bench saw the old worker exit; old_gone_and_status_ready_s when it"
        " has also been reaped.",
        "breakdown (daemon log, ms resolution): death_noticed = kill -> daemon reaps the old worker;"
        " event_to_forked = kill/request -> the new worker is forked (sigkill, graceful, no zygote);"
        " event_to_promoted = kill -> the daemon's `spare (pid P, standby) takes slot 0` (sigkill-spare);"
        " forked_to_ready / promoted_to_ready = from that line to the daemon's `worker 0 ready`; go_to_ready = the"
        " daemon's own figure, from the slot given to ready; worker_ready_in = the worker's own figure from the top of"
        " serve() (forked workers only: a spare counts from its own start); ready->200 = the rest of the total;"
        " old exit = kill/request -> the old worker has exited (a zombie counts; the bench polls every 2 ms);"
        " zygote renewed = the daemon renewed its zygote during the restart because the installed code changed"
        " (files edited meanwhile): that restart then includes the zygote's imports.",
        "memory: the daemons measured have --spare-workers 0 (memory_1 is the sigkill/graceful daemon after its"
        f" restarts, memory_{memory_workers} a daemon of its own), so the figures are about N workers; memory_1+1spare"
        " is the sigkill-spare daemon, with its spare in standby. USS counts pages mapped by this process alone"
        " (with ONE worker that includes the arena pages it has touched, since the daemon never maps the arena); PSS"
        " splits shared pages among their users; shmem (RssShmem) counts the arena pages a worker has mapped; anon"
        " (RssAnon) is its heap: on CPU its own KV cache (kv_cache_bytes, 512 MiB with --kv-cache-memory auto) plus"
        " pages still shared copy-on-write with the zygote. Weights are shared when, with N workers, USS/wkr does not"
        " include shmem/wkr and sum PSS is about N x USS/wkr + the arena pages touched, not N x the arena.",
        "device memory (CUDA only; nvidia-smi, never a CUDA context in the bench process): per process from"
        " --query-compute-apps (daemon = its context and buffers; the arena (the weights, cuda-vmm) is charged to"
        " no process, so it is memory.used less the processes' sum, 'no process': about the arena's bytes, once,"
        " whatever the number of workers, shows the weights are not copied; each worker = its KV"
        " cache (kv_cache_bytes from /status: auto = its share of"
        f" {GPU_MEMORY_UTILIZATION} x device - weights - reserves, at most what max_num_seqs sequences of the model's"
        " full context can use: a small model gets far less) plus its context and workspaces, no weights;"
        " the zygote must hold none); the device's memory.used against"
        f" {GPU_MEMORY_UTILIZATION} x memory.total; and memory.used just before each daemon started and after it"
        " stopped (polled until back within"
        f" {GPU_BASELINE_SLACK_MIB} MiB of that baseline, {GPU_SETTLE_TIMEOUT:.0f} s at most).",
    ]


# ---- the table -----------------------------------------------------------------------------------


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def _m(n: int | float | None) -> str:  # already MiB
    return "-" if n is None else f"{n:.0f}"


def _row(cells, widths) -> str:
    return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def _memory_keys(r: dict) -> list[str]:
    keys = [k for k in r if k.startswith("memory_")]
    return sorted(keys, key=lambda k: (int(re.match(r"memory_(\d+)", k)[1]), k))


def format_table(result: dict) -> str:
    m = result["machine"]
    gpu = f", {m['cuda_device']} ({m['gpu_total_mib']} MiB)" if m.get("cuda_device") else ""
    lines = [
        f"preload bench restart: {result['restarts']} restarts of each kind, {result['cold_repeat']} cold starts,"
        f" {result.get('wall_s', 0):.0f} s in all",
        f"machine: {m['hostname']}, nproc {m['nproc']} ({m.get('cpu_model') or '?'}){gpu}, torch {m['torch']},"
        f" load avg before {result['loadavg_before'][0]:.2f}, after {result['loadavg_after'][0]:.2f}",
        "",
    ]
    head = ("model", "weights MiB", "kind", "p50 s", "p90 s", "min s", "max s", "/cold exit", "/cold API", "checks")
    widths = (14, 11, 17, 7, 7, 7, 7, 10, 9, 0)
    lines.append(_row(head, widths))
    for r in result["models"]:
        c = r["cold"]
        lines.append(_row((r["label"], _mib(r["weight_bytes"]), "cold: start exit", _s(c["exit_s"]["p50"]),
                           _s(c["exit_s"]["p90"]), _s(c["exit_s"]["min"]), _s(c["exit_s"]["max"]), "", "", ""), widths))
        if c["api_health_s"]:
            q = c["api_health_s"]
            lines.append(_row(("", "", "cold: API 200", _s(q["p50"]), _s(q["p90"]), _s(q["min"]), _s(q["max"]), "", "",
                               ""), widths))
        for key, name in (("cold_spare", "cold, 1 spare"), ("cold_no_zygote", "cold, no zygote")):
            if key in r:
                lines.append(_row(("", "", name, _s(r[key]["exit_s"]), "", "", "", "", "", ""), widths))
        for kind, k in r["restart"].items():
            q = k["seconds"]
            api = k["ratio_p50_over_cold_api_health"]
            n = q["n"]
            checks = []
            if "promoted" in k:
                checks.append(f"spare promoted {k['promoted']}/{n} (from standby {k['promoted_from_standby']})")
            if "drained_first" in k:
                checks.append(f"old drained first {k['drained_first']}/{n}")
            if k.get("zygote_renewed"):
                checks.append(f"zygote renewed (code changed) {k['zygote_renewed']}/{n}")
            if k.get("kv_cache_changed"):
                checks.append(f"KV cache size changed {k['kv_cache_changed']}/{n}")
            lines.append(_row(("", "", kind, _s(q["p50"]), _s(q["p90"]), _s(q["min"]), _s(q["max"]),
                               f"{k['ratio_p50_over_cold_exit']:.3f}", "-" if api is None else f"{api:.3f}",
                               "; ".join(checks)), widths))
    lines += ["", "where a restart's time goes (medians, seconds; from the daemon's and the worker's logs;"
                  " ->start = ->forked, or ->promoted for sigkill-spare):"]
    head = ("model", "kind", "p50", "p90", "->reaped", "->start", "start->ready", "worker's own", "ready->200",
            "old exit", "next spare")
    widths = (14, 17, 7, 7, 8, 7, 12, 12, 10, 8, 10)
    lines.append(_row(head, widths))
    for r in result["models"]:
        for kind, k in r["restart"].items():
            b = k["breakdown_median"]
            total = k["seconds"]["p50"]
            to_start = b.get("event_to_promoted_s") if kind == "sigkill-spare" else b.get("event_to_forked_s")
            start_ready = b.get("promoted_to_ready_s") if kind == "sigkill-spare" else b.get("forked_to_ready_s")
            rest = None if to_start is None or start_ready is None else total - to_start - start_ready
            lines.append(_row((r["label"], kind, _s(total), _s(k["seconds"]["p90"]), _s(b.get("death_noticed_s")),
                               _s(to_start), _s(start_ready), _s(b.get("worker_ready_in_s")), _s(rest),
                               _s(b.get("old_exit_s")), _s(b.get("next_spare_standby_s"))), widths))
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
    lines += ["", "host memory (MiB; per worker: mean over workers; anon = private heap + KV cache on CPU,"
                  " shmem = arena pages mapped; KV = kv_cache_bytes from /status):"]
    head = ("model", "workers", "arena", "KV/wkr", "RSS/wkr", "anon/wkr", "shmem/wkr", "USS/wkr", "PSS/wkr", "sum USS",
            "sum PSS", "daemon RSS", "spare RSS")
    widths = (14, 9, 8, 8, 8, 8, 9, 8, 8, 8, 8, 10, 9)
    lines.append(_row(head, widths))
    for r in result["models"]:
        for key in _memory_keys(r):
            mem = r[key]
            n = mem["workers"]
            mean = lambda f: sum(x.get(f, 0) for x in mem["per_worker"]) / n  # noqa: E731
            ns = mem.get("spares", 0)
            spare_rss = sum(x["rss"] for x in mem.get("per_spare", [])) / ns if ns else None
            lines.append(_row((r["label"], f"{n}" + (f"+{ns}sp" if ns else ""), _mib(mem["arena_bytes"]),
                               _mib(mean("kv_cache_bytes")), _mib(mean("rss")), _mib(mean("anon")), _mib(mean("shmem")),
                               _mib(mean("uss")), _mib(mean("pss")), _mib(mem["sum_worker_uss"]),
                               _mib(mem["sum_worker_pss"]), _mib(mem["daemon"]["rss"]), _mib(spare_rss)), widths))
    gpu_rows = [(r, k) for r in result["models"] for k in _memory_keys(r) if "gpu" in r[k]]
    if gpu_rows:
        lines += ["", "device memory (MiB; nvidia-smi per process and memory.used; KV = kv_cache_bytes from /status;"
                      " no process = memory.used less every process's figure: the cuda-vmm arena, which nvidia-smi"
                  " charges to no process; wkr each = min..max over workers;"
                  " wkr-KV = what a worker holds beyond its KV cache: context, workspaces):"]
        head = ("model", "workers", "arena", "daemon", "no process", "wkr each", "KV/wkr", "wkr-KV", "spare", "other",
                "used", f"{GPU_MEMORY_UTILIZATION}xtotal", "total", "before", "after stop")
        widths = (14, 9, 8, 7, 10, 13, 8, 7, 6, 6, 7, 10, 7, 7, 10)
        lines.append(_row(head, widths))
        for r, key in gpu_rows:
            g = r[key]["gpu"]
            unattributed = g.get("unattributed_mib", g["used_mib"] - sum(p["used_mib"] or 0 for p in g["per_process"]))
            ws = g["per_worker"]
            used = sorted(w["used_mib"] for w in ws if w["used_mib"] is not None)
            each = "-" if not used else _m(used[0]) if used[0] == used[-1] else f"{used[0]:.0f}..{used[-1]:.0f}"
            kv = statistics.mean(w["kv_cache_bytes"] for w in ws) if ws else None
            beyond = [w["beyond_kv_mib"] for w in ws if w["beyond_kv_mib"] is not None]
            n, ns = r[key]["workers"], r[key].get("spares", 0)
            after = g.get("used_after_stop_mib")
            lines.append(_row((r["label"], f"{n}" + (f"+{ns}sp" if ns else ""), _mib(g["arena_bytes"]),
                               _m(g["daemon_mib"]), _m(unattributed), each, _mib(kv), _m(statistics.mean(beyond) if beyond else None),
                               "/".join(_m(x) for x in g["spare_mib"]) or "-", _m(g["other_mib"]), _m(g["used_mib"]),
                               _m(g["utilization_cap_mib"]), _m(g["total_mib"]), _m(g.get("used_before_start_mib")),
                               _m(after) + ("" if g.get("returned_to_baseline", True) else " (!)")), widths))
            if not g["pids_matched"]:
                lines.append(f"  {r['label']} {key}: nvidia-smi's pids are not this PID namespace's: per process"
                             f" figures unmatched ({g['per_process']})")
            if g["zygote_on_device"]:
                lines.append(f"  {r['label']} {key}: the zygote holds device memory")
        for r in result["models"]:
            for b in r.get("gpu_baseline", []):
                if not b["returned_to_baseline"] or b["pids_left_on_device"]:
                    lines.append(f"  {r['label']}: after the {b['daemon'] or 'a'} daemon stopped the device stayed at"
                                 f" {b['used_after_stop_mib']} MiB (baseline {b['used_before_start_mib']} MiB),"
                                 f" processes left on it: {b['pids_left_on_device'] or 'none'}")
        for r in result["models"]:
            if r.get("gpu_baseline"):
                lines.append(f"  {r['label']}: device used before start -> after stop, each daemon (MiB): "
                             + ", ".join(f"{b['daemon']} {b['used_before_start_mib']}->{b['used_after_stop_mib']}"
                                         for b in r["gpu_baseline"]))
    errors = {r["label"]: r.get("status_errors", 0) for r in result["models"]}
    if any(errors.values()):
        lines += ["", f"daemon /status answered non-200 (retried) this many times: {errors}"]
    lines += ["", *("- " + n for n in result["notes"])]
    return "\n".join(lines)
