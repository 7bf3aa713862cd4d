"""One `preload start` timed, as bench/cold.py runs it: the real command to ready, the
memory of its process tree sampled every POLL_S, the daemon's /status and the timeline
its logs and its worker's give, the first request's time, then `preload stop`."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from preload.bench.driver import free_port, preload, running_daemon
from preload.bench.memory import proc_memory

POLL_S = 0.02


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
