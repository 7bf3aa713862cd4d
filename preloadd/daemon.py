"""The preload daemon: owns the state dir, loads the weights once, serves them.

Lifecycle: take the state dir's lock, start /health (503 while loading), load the
checkpoint into a sealed arena, open the control sockets, report ready, then serve
until SIGTERM/SIGINT or a `shutdown` request. Whatever happens, it leaves no
sockets or arenas behind.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from preload.ipc.protocol import ProtocolError, fd_socket_path
from preload.preloadd.control import ControlServer, PeerPolicy
from preload.preloadd.health import DaemonMetrics, HttpServer, bind, make_app
from preload.preloadd.loader import Loaded, Progress, load
from preload.preloadd.supervisor import Supervisor
from preload.worker.serve import listen

log = logging.getLogger("preload.daemon")


class DaemonError(RuntimeError):
    """A start-up failure with a one-line explanation for the operator."""


@dataclass
class DaemonOptions:
    model: Path
    quant: str
    device: torch.device
    dtype: torch.dtype
    transport: str
    state_dir: Path
    health_host: str = "127.0.0.1"
    health_port: int = 8001
    allow_uids: set[int] = field(default_factory=set)
    allow_gids: set[int] = field(default_factory=set)
    workers: int = 0  # engine workers to supervise (0: weights only)
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    worker_spec: dict = field(default_factory=dict)  # the workers' serve options (see worker/serve.py)
    use_zygote: bool = True
    spares: int = 0  # warm spare workers beside them
    ready_timeout: float = 300.0


def prepare_state_dir(path: Path, others_allowed: bool) -> None:
    """Create the state dir, or check that an existing one is ours: 0700, or 0711 (others
    may reach the sockets, not list the dir) when other uids or gids are allow-listed."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise DaemonError(f"state dir {path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()})")
    os.chmod(path, 0o711 if others_allowed else 0o700)


class PidLock:
    """An flock on a file holding the owner's pid; the kernel drops it when the owner
    dies, however it dies. `what` names the resource in the refusal."""

    def __init__(self, path: Path, what: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except PermissionError:
            raise DaemonError(f"{what} is in use by another user's preload daemon ({path})") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode().strip() or "?"
            os.close(self.fd)
            raise DaemonError(f"another preload daemon (pid {holder}) is running on {what}") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        os.ftruncate(self.fd, 0)
        os.close(self.fd)


def device_lock(device: torch.device) -> PidLock | None:
    """One daemon per GPU (by UUID, whatever CUDA_VISIBLE_DEVICES says); CPUs are shared."""
    if device.type != "cuda":
        return None
    uuid = torch.cuda.get_device_properties(device).uuid
    return PidLock(Path(tempfile.gettempdir()) / f"preload-gpu-{uuid}.lock", f"device {device} (GPU {uuid})")


def last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "nothing"
    return lines[-1].strip() if lines else "nothing"


class Daemon:
    def __init__(self, opts: DaemonOptions):
        self.opts = opts
        self.state = "starting"
        self.error: str | None = None
        self.progress = Progress()
        self.loaded: Loaded | None = None
        self.clients: dict[int, float] = {}  # attached pid -> since; the control thread and HTTP threads share it
        self._clients_lock = threading.Lock()
        self.started = time.time()
        self.metrics = DaemonMetrics()
        self.stop_requested = threading.Event()
        self.control: ControlServer | None = None
        self.supervisor: Supervisor | None = None
        self.errors = 0

    # ---- requests -------------------------------------------------------------

    def handle(self, msg: dict, pid: int) -> dict:
        op = msg["op"]
        if op == "status":
            return {"status": self.status()}
        if op == "hello":
            with self._clients_lock:
                self.clients[pid] = time.time()
            self.metrics.attaches.inc()
            return {"fingerprint": self.loaded.manifest["fingerprint"], "pid": os.getpid()}
        if op == "manifest":
            return {"manifest": self.loaded.manifest}
        if op == "release":
            with self._clients_lock:
                self.clients.pop(pid, None)
            return {}
        if op == "worker_warm":
            return {"known": self.supervisor is not None and self.supervisor.mark_warm(pid)}
        if op == "worker_ready":
            kv = msg.get("kv_cache_bytes", 0)
            if not isinstance(kv, int):
                raise ProtocolError("kv_cache_bytes must be an integer")
            return {"known": self.supervisor is not None and self.supervisor.mark_ready(pid, kv)}
        if op == "restart":
            if self.supervisor is None:
                return {"ok": False, "error": "this daemon runs no workers (start it with --workers N)"}
            drain = self.opts.worker_spec.get("drain_timeout", 30.0)
            threading.Thread(target=self.supervisor.restart, args=(bool(msg.get("now")), drain), daemon=True).start()
            return {}
        if op == "shutdown":
            log.info("shutdown requested by pid %d", pid)
            self.stop_requested.set()
            return {}
        raise AssertionError(op)

    def room_for(self, kv_cache_bytes: int) -> bool:
        """Whether one more KV cache of this size fits on the device within the
        utilization the workers were given (host memory is not budgeted)."""
        if self.opts.device.type != "cuda":
            return True
        free, total = torch.cuda.mem_get_info(self.opts.device)
        return free - kv_cache_bytes >= (1 - self.opts.worker_spec.get("gpu_memory_utilization", 0.9)) * total

    def arena_fds(self) -> tuple[dict, list[int]]:
        return self.loaded.arena.info(), self.loaded.arena.fds()

    def attached(self) -> list[int]:
        with self._clients_lock:
            for pid in [p for p in self.clients if not psutil.pid_exists(p)]:
                del self.clients[pid]
            alive = sorted(self.clients)
        self.metrics.attached.set(len(alive))
        return alive

    def status(self) -> dict:
        o = self.opts
        m = self.loaded.manifest if self.loaded else {}
        resident = self.loaded.arena.size if self.loaded else 0
        return {
            "state": self.state,
            "error": self.error,
            "pid": os.getpid(),
            "model": str(o.model),
            "quant": o.quant,
            "dtype": str(o.dtype).removeprefix("torch."),
            "device": str(o.device),
            "transport": o.transport,
            "state_dir": str(o.state_dir),
            "bytes_per_device": {str(o.device): resident},
            "fingerprint": m.get("fingerprint"),
            "attached_workers": self.attached(),
            "uptime_s": round(time.time() - self.started, 3),
            "load_seconds": self.progress.seconds,
            "progress": self.progress.as_dict(),
            "errors": self.errors,
            "workers": self.supervisor.status() if self.supervisor else [],
            "spares": self.supervisor.spare_status() if self.supervisor else [],
            "zygote_restarts": self.supervisor.zygote_restarts if self.supervisor else 0,
        }

    # ---- lifecycle ------------------------------------------------------------

    def run(self, notify: Callable[[dict], None]) -> None:
        """Start, report ready through `notify`, serve until asked to stop, clean up."""
        o = self.opts
        prepare_state_dir(o.state_dir, PeerPolicy(o.allow_uids, o.allow_gids).others_allowed)
        lock = PidLock(o.state_dir / "daemon.lock", f"state dir {o.state_dir}")
        gpu_lock = http = api = None
        try:
            gpu_lock = device_lock(o.device)
            for stale in (o.state_dir / "control.sock", fd_socket_path(o.state_dir)):
                stale.unlink(missing_ok=True)  # left by a daemon that was killed; we hold the lock now
            try:
                http = HttpServer(make_app(self.status, self.metrics), bind(o.health_host, o.health_port))
            except OSError as e:
                raise DaemonError(f"health port: {e}") from None
            if o.workers:
                try:  # bound now, so that clients queue in its backlog from the start
                    api = listen(o.api_host, o.api_port)
                except OSError as e:
                    raise DaemonError(f"API port: cannot listen on {o.api_host}:{o.api_port}: {e.strerror}") from None
            self._install_signal_handlers()
            if o.workers:
                self.supervisor = Supervisor(o.workers, o.worker_spec, api, o.use_zygote, o.spares, self.room_for)
                self.supervisor.prepare()  # the zygote imports while we load
            self.state = "loading"
            log.info("loading %s (quant %s, %s, %s)", o.model, o.quant, o.dtype, o.device)
            last = [0.0]

            def on_progress(p: Progress) -> None:
                if time.monotonic() - last[0] > 0.2:
                    last[0] = time.monotonic()
                    notify({"progress": p.done_bytes, "total": p.total_bytes})

            self.loaded = load(o.model, o.quant, o.dtype, o.device, o.transport, self.progress, on_progress)
            self.metrics.load_seconds.set(self.progress.seconds)
            self.metrics.resident_bytes.labels(str(o.device)).set(self.loaded.arena.size)
            policy = PeerPolicy(o.allow_uids, o.allow_gids)
            self.control = ControlServer(o.state_dir, policy, self.handle, self.arena_fds, self._on_error)
            if self.supervisor:
                self.supervisor.start()
                if not self.supervisor.all_ready(o.ready_timeout):
                    last = last_line(o.state_dir / "worker-0.log")
                    raise DaemonError(f"workers not ready within {o.ready_timeout:.0f} s (worker 0 said: {last}); "
                                      f"see {o.state_dir}/worker-*.log")
            self.state = "ready"
            fp = self.loaded.manifest["fingerprint"]
            log.info("ready in %.2f s: %d bytes resident, fingerprint %s", self.progress.seconds, self.loaded.arena.size, fp)
            notify({"ready": True, "pid": os.getpid(), "fingerprint": fp, "seconds": self.progress.seconds,
                    "workers": o.workers, "port": o.api_port})
            while not self.stop_requested.wait(0.5):
                pass
            self.state = "stopping"
            log.info("stopping")
        finally:
            if self.supervisor:
                self.supervisor.stop(timeout=o.worker_spec.get("drain_timeout", 30.0) + 5)
            if api:
                api.close()
            if self.control:
                self.control.close()
            if self.loaded:
                self.loaded.arena.close()
            if http:
                http.close()
            if gpu_lock:
                gpu_lock.release()
            lock.release()

    def _on_error(self) -> None:
        self.errors += 1
        self.metrics.errors.inc()

    def _install_signal_handlers(self) -> None:
        def stop(signum, _frame):
            log.info("received %s", signal.Signals(signum).name)
            self.stop_requested.set()
            if self.state == "loading":
                raise KeyboardInterrupt  # abandon the load; run()'s cleanup still happens

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
