"""The preload daemon: owns the state dir, loads the weights once, serves them.

Lifecycle: take the state dir's lock, start /health (503 while loading), load the
checkpoint into a sealed arena, open the control sockets, start the workers (if any),
report ready, then serve until SIGTERM/SIGINT or a `shutdown` request. Whatever
happens, it leaves no sockets or arenas behind.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from preload.checkpoint.config import ModelConfig, weights_dtype
from preload.checkpoint.identity import changed_on_disk
from preload.ipc.arena import HeldArena, default_transport
from preload.ipc.devices import data_parallel_devices, gpu_uuid, memory_info, resolve_device_name
from preload.ipc.protocol import ProtocolError, fd_socket_path
from preload.ipc.sockets import listen
from preload.options import BUNDLED_MODEL, DaemonOptions, ServeOptions
from preload.preloadd import keeper, systemd
from preload.preloadd.control import ControlServer, PeerPolicy
from preload.preloadd.copy_loader import CopyPlan, copy_plan, load_copied
from preload.preloadd.health import DaemonMetrics, HttpServer, make_app, prepare_metrics_dir
from preload.preloadd.keeper import KeeperLink, Kept
from preload.preloadd.orphans import Adoption, OrphanListener, orphan_slots
from preload.preloadd.sleeping import Sleeper
from preload.preloadd.state_dir import (
    DAEMON_FILE,
    KERNEL_CACHE_ENV,
    METRICS_DIR,
    MULTIPROC_ENV,
    PidLock,
    device_lock,
    kernel_cache_dir,
    prepare_state_dir,
    write_private_json,
)
from preload.preloadd.status import daemon_status
from preload.preloadd.supervisor import Supervisor
from preload.preloadd.weights import Loaded, LoadError, Progress, kept_manifest
from preload.preloadd.zygote import Zygote

log = logging.getLogger("preload.daemon")


class DaemonError(RuntimeError):
    """A start-up failure with a one-line explanation for the operator."""


@dataclass(frozen=True)
class Resolved:
    """The daemon's options with every `auto` decided for this machine, by name: torch is
    imported only for a load with arithmetic to do (quantizing, converting; not a copy, not
    taking weights back from a keeper)."""

    model: Path
    device: str  # "cpu", "cuda" or "cuda:N", as torch prints it: data-parallel rank 0's
    dtype: str  # of the weights before quantization: "bfloat16", ...
    transport: str
    spares: int  # a rank's
    devices: tuple[str, ...]  # each data-parallel rank's (--data-parallel-size): a copy of the weights on each

    @classmethod
    def of(cls, o: DaemonOptions) -> Resolved:
        model = Path(o.model or BUNDLED_MODEL).absolute()
        devices = tuple(data_parallel_devices(resolve_device_name(o.device), o.data_parallel_size))
        device = devices[0]
        dtype = weights_dtype(None if o.dtype == "auto" else o.dtype, device.partition(":")[0], ModelConfig.from_dir(model))
        transport = default_transport(device) if o.transport == "auto" else o.transport
        spares = o.spare_workers if o.spare_workers is not None else int(device != "cpu" and o.workers > 0)
        return cls(model, device, dtype, transport, spares, devices)


def last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "nothing"
    return lines[-1].strip() if lines else "nothing"


class Daemon:
    def __init__(self, opts: DaemonOptions, zygote: Zygote | None = None):
        """`zygote`: the first zygote, launched already (zygote.launch_early), for the supervisor."""
        self.opts, self.r = opts, Resolved.of(opts)
        self.early_zygote = zygote
        self.state = "starting"
        self.error: str | None = None
        self.progress = Progress()
        self.copies: list[Loaded] = []  # the weights, a copy per data-parallel rank ([] before the load, asleep)
        self.clients: dict[int, float] = {}  # attached pid -> since; the control thread and HTTP threads share it
        self._clients_lock = threading.Lock()
        self.started = time.time()
        self.metrics = DaemonMetrics()
        self.ports: dict[str, int | None] = {}
        self.stop_requested = threading.Event()
        self.control: ControlServer | None = None
        self.supervisor: Supervisor | None = None
        self.keeper: KeeperLink | None = None
        self.readopted = False  # the weights were taken back from a keeper, not loaded
        self._keeper_stale = False  # the keeper we took over holds an API socket we do not serve
        self.errors = 0
        self.api: socket.socket | None = None  # the API's listening socket, if workers serve one
        self.sleeper = Sleeper(self)

    # ---- requests (from the control thread) ------------------------------------------------

    def handle(self, msg: dict, pid: int) -> dict:
        op = msg["op"]
        if op == "status":
            return {"status": self.status()}
        if op == "hello":
            copy = self.weights(msg.get("dp_rank", 0))
            with self._clients_lock:
                self.clients[pid] = time.time()
            self.metrics.attaches.inc()
            return {"fingerprint": copy.manifest.fingerprint, "pid": os.getpid()}
        if op == "manifest":
            return {"manifest": self.weights(msg.get("dp_rank", 0)).manifest.to_wire()}
        if op == "release":
            with self._clients_lock:
                self.clients.pop(pid, None)
            return {}
        if op in ("sleep", "wake"):
            return self.sleeper.ask(op, msg.get("level"))
        if op == "restart":
            if self.supervisor is None:
                return {"ok": False, "error": "this daemon runs no workers (start it with --workers N)"}
            if self.state != "ready":
                return {"ok": False, "error": f"the daemon is {self.state}: nothing to restart (`preload wake` first)"}
            self.supervisor.restart(now=bool(msg.get("now")))
            return {"checkpoint_changed": self._changed_on_disk()}
        if op == "shutdown":
            log.info("shutdown requested by pid %d", pid)
            self.stop_requested.set()
            return {}
        raise AssertionError(op)

    def _changed_on_disk(self) -> list[str]:
        """The checkpoint's files that changed since the load (a restart keeps the weights
        loaded: said, not done silently; a new start would load the files as they are)."""
        manifest = self.weights().manifest
        aux, touched = changed_on_disk(self.r.model, manifest.record)
        if aux or touched:
            log.warning("restart: the checkpoint changed on disk since the load (%s); the workers restart on the weights"
                        " loaded (fingerprint %s)", ", ".join(aux + touched), manifest.fingerprint)
        return aux + touched

    def room_for(self, kv_cache_bytes: int, dp_rank: int = 0) -> bool:
        """Whether one more KV cache of this size fits on the rank's device within the
        utilization the workers were given (host memory is not budgeted)."""
        device = self.r.devices[dp_rank]
        if device == "cpu":
            return True
        free, total = memory_info(device)  # (the driver's answer: this daemon may never import torch)
        return free - kv_cache_bytes >= (1 - self.opts.worker.engine.gpu_memory_utilization) * total

    def arena_fds(self, dp_rank: int = 0) -> tuple[dict, list[int]]:
        copy = self.weights(dp_rank)
        return copy.arena.info().to_wire(), copy.arena.fds()

    def weights(self, dp_rank: int = 0) -> Loaded:
        """Rank `dp_rank`'s copy of the weights, for a client to attach; ProtocolError (its
        reply) while none are held, or for a rank this daemon does not have."""
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < len(self.r.devices):
            raise ProtocolError(f"dp_rank {dp_rank!r}: this daemon holds ranks 0 to {len(self.r.devices) - 1}")
        if not self.copies:
            raise ProtocolError(f"the daemon holds no weights now ({self.state}): they come back with `preload wake`")
        return self.copies[dp_rank]

    def let_weights_go(self) -> None:
        """Sleep level 2: the keeper's hold and the arenas go (no core maps them now): the memory is freed."""
        if self.keeper is not None:
            self.keeper.release()
            self.keeper = None
        for copy in self.copies:
            copy.arena.close()
        self.copies = []
        log.info("weights let go")

    def spawn_keeper(self) -> None:
        """Our keeper, its interpreter started now, beside a load or a wake's copy: given the
        weights once they are resident (_keep), it is not a wait between those and ready."""
        if self._keeps() and self.keeper is None:
            self.keeper = KeeperLink.spawn(self.opts.state_dir)

    def load_again(self, copies: list[Loaded] | None = None) -> None:
        """A wake: the weights put back (`copies`, from host memory: sleep level 1 on a GPU)
        or loaded as at a start (level 2); the keeper given them."""
        if copies is not None:
            self._loaded(copies)
        else:
            self.progress = Progress()
            self._load(lambda msg: None, None, copy_plan(self.r.model, self.opts.quant, self.r.dtype,
                                                         self.r.transport, self.r.device))
        self._keep(self.api)
        if self.keeper:
            self.keeper.wait_kept()

    def attached(self) -> list[int]:
        with self._clients_lock:
            for pid in [p for p in self.clients if not psutil.pid_exists(p)]:
                del self.clients[pid]
            alive = sorted(self.clients)
        self.metrics.attached.set(len(alive))
        return alive

    def status(self) -> dict:
        return daemon_status(self)

    # ---- lifecycle ------------------------------------------------------------------------

    def run(self, notify: Callable[[dict], None]) -> None:
        """Start, report ready through `notify`, serve until asked to stop, clean up."""
        o, r = self.opts, self.r
        policy = PeerPolicy(set(o.allow_uid), set(o.allow_gid))
        prepare_state_dir(o.state_dir, policy.others_allowed)
        lock = PidLock(o.state_dir / "daemon.lock", f"state dir {o.state_dir}")
        gpu_locks, http, api = [], None, None
        try:
            for device in dict.fromkeys(d for d in r.devices if d != "cpu"):
                gpu_locks.append(device_lock(device, gpu_uuid(device)))
            for stale in (o.state_dir / "control.sock", fd_socket_path(o.state_dir)):
                stale.unlink(missing_ok=True)  # left by a daemon that was killed; we hold the lock now
            kept = self._take_kept()  # what a keeper of a dead daemon of this state dir holds
            http = HttpServer(make_app(self.status, self.metrics, self.sleeper.ask if o.workers else None,
                                       o.worker.key), self._listen("health", o.health_host, o.health_port))
            # The API socket is bound now (or was kept open all along), so that clients queue in its backlog
            # from the start.
            api = self._kept_api(kept)
            if o.workers and api is None:
                api = self._listen("API", o.host, o.port)
            self.api = api
            # The ports as bound (--port 0 picks them), for status, the start line and `preload status`
            # while the control socket is not up yet (during the load).
            self.ports = {"health": http.sock.getsockname()[1], "api": api.getsockname()[1] if api else None}
            log.info("health port %s:%d%s", o.health_host, self.ports["health"],
                     f", API port {o.host}:{self.ports['api']}" if api else "")
            write_private_json(o.state_dir / DAEMON_FILE, {"pid": os.getpid(), "health_host": o.health_host,
                                                            "health_port": self.ports["health"],
                                                            "api_port": self.ports["api"]})
            self._install_signal_handlers()
            copying = copy_plan(r.model, o.quant, r.dtype, r.transport, r.device) if kept is None else None
            if kept is None and copying is None:
                # A load with arithmetic follows: torch now (/health answers meanwhile), before the
                # zygote's import competes. (A copy needs none: preloadd/copy_loader.py.)
                import torch  # noqa: F401
            if o.workers:
                if r.device != "cpu":  # (the CPU's kernels are torch's: nothing compiled)
                    os.environ[KERNEL_CACHE_ENV] = str(kernel_cache_dir(o.state_dir))
                # The workers' metrics, one file per process, read together by every /metrics
                # (worker/api/metrics.py): those of the workers a killed daemon left carry on, with
                # what the ones that died meanwhile counted (health.prepare_metrics_dir).
                metrics_dir = o.state_dir / METRICS_DIR
                prepare_metrics_dir(metrics_dir)
                os.environ[MULTIPROC_ENV] = str(metrics_dir)
                self.metrics.read_workers(metrics_dir, vllm_names=o.worker.vllm_metrics)
                serve = ServeOptions(state_dir=o.state_dir, host=o.host, port=o.port, worker=o.worker,
                                     workers=o.workers, spares=r.spares)
                self.supervisor = Supervisor(o, serve, r.spares, api, self.room_for, self.early_zygote, r.device != "cpu",
                                             len(r.devices))
                self.supervisor.prepare()  # the zygote imports while we load
            if kept is None:
                self.spawn_keeper()
            self._load(notify, kept, copying)
            if self.keeper is not None and self._keeper_stale:
                self.keeper.release()  # it holds an API socket we no longer serve; ours hold the weights
                self.keeper = None
            self._keep(api)
            self.control = ControlServer(o.state_dir, policy, self.handle, self.arena_fds, self._on_error)
            if self.supervisor:
                self.supervisor.start(Adoption(OrphanListener(o.state_dir), self.copies[0].manifest.fingerprint,
                                               list(api.getsockname()[:2]), orphan_slots(o.state_dir),
                                               orphan_slots(o.state_dir, "front"), took_back=self.readopted))
                why = self.supervisor.wait_started(o.worker_start_timeout)
                if why:
                    said = last_line(o.state_dir / "worker-0.log")
                    raise DaemonError(f"{why} (worker 0 said: {said}); see {o.state_dir}/worker-*.log")
            else:
                for slot, pid in orphan_slots(o.state_dir).items():  # (titles of our uid: ours to stop)
                    log.warning("worker %d (pid %d), left by the last daemon, retires: this one runs no workers", slot, pid)
                    os.kill(pid, signal.SIGTERM)  # it drains and exits
            if self.keeper:
                self.keeper.wait_kept()
            self.state = "ready"
            fp, n = self.copies[0].manifest.fingerprint, o.workers * len(r.devices)
            log.info("ready in %.2f s: %d bytes resident, fingerprint %s", self.progress.seconds,
                     sum(copy.arena.size for copy in self.copies), fp)
            notify({"ready": True, "pid": os.getpid(), "fingerprint": fp, "seconds": self.progress.seconds,
                    "workers": n, "port": self.ports["api"], "health_port": self.ports["health"]})
            systemd.notify(READY="1", MAINPID=str(os.getpid()),
                           STATUS=f"ready: {n} worker{'s' * (n != 1)} on port {self.ports['api']}, fingerprint {fp}")
            while not self.stop_requested.is_set():
                self.sleeper.poke.wait(0.5)
                self.sleeper.poke.clear()
                self._watch_keeper(api)
                self.sleeper.turn()
            self.state = "stopping"
            log.info("stopping")
            systemd.notify(STOPPING="1", STATUS="stopping")
        finally:
            if self.supervisor:
                self.supervisor.stop(timeout=o.worker.drain_timeout + 5)
            if api:
                api.close()
            if self.control:
                self.control.close()
            for copy in self.copies:
                copy.arena.close()
            if self.keeper:
                self.keeper.release()  # a clean stop: the weights go
            if http:
                http.close()
                (o.state_dir / DAEMON_FILE).unlink(missing_ok=True)
            for gpu_lock in gpu_locks:
                gpu_lock.release()
            lock.release()

    def _keep(self, api) -> None:
        """Our keeper (spawned if need be) holds the weights and the API socket from now on."""
        if self._keeps():
            self.keeper = self.keeper or KeeperLink.spawn(self.opts.state_dir)
            if self.keeper.empty:
                self.keeper.give(self._kept(api))

    def _watch_keeper(self, api) -> None:
        """A keeper that died (killed, crashed) is replaced at once: a new one is given the
        weights and the API socket, so that a later crash of this daemon still loses
        nothing and the next `preload start` takes them back (issue 36: a dead keeper went
        unnoticed, and after the daemon's death the API port could not be listened on)."""
        k = self.keeper
        if k is None or k.empty or not k.dead():
            return
        log.error("the keeper (pid %d) died; a new keeper takes the weights and the API socket", k.pid)
        k.forget()
        self.keeper = None  # (/status names a keeper once it holds them)
        new = KeeperLink.spawn(self.opts.state_dir)
        new.give(self._kept(api))
        new.wait_kept()
        self.keeper = new
        log.info("a new keeper (pid %d) holds the weights and the API socket", new.pid)

    def _kept(self, api) -> Kept:
        return Kept([c.manifest.to_wire() for c in self.copies], [c.arena.fds() for c in self.copies], api)

    def _keeps(self) -> bool:
        """Whether a keeper holds the weights through a crash (cuda-ipc handles die with us)."""
        return self.opts.keeper and self.r.transport != "cuda-ipc"

    def _listen(self, what: str, host: str, port: int) -> socket.socket:
        try:
            return listen(host, port)
        except OSError as e:
            raise DaemonError(f"{what} port: {e.strerror}") from None

    def _take_kept(self) -> tuple[KeeperLink, Kept] | None:
        try:
            return keeper.take(self.opts.state_dir)
        except (OSError, ProtocolError) as e:
            log.warning("the keeper in %s did not hand over: %s", self.opts.state_dir, e)
            return None

    def _kept_api(self, found: tuple[KeeperLink, Kept] | None) -> socket.socket | None:
        """The kept API socket, if it is bound where this daemon is to listen."""
        if found is None:
            return None
        sock, found[1].api = found[1].api, None
        if sock is None:
            self._keeper_stale = bool(self.opts.workers)  # it keeps no API socket; ours needs keeping
            return None
        host, port = sock.getsockname()[:2]
        try:
            same_host = host in (self.opts.host, socket.gethostbyname(self.opts.host))
        except OSError:
            same_host = False
        if self.opts.workers and self.opts.port in (0, port) and same_host:
            log.info("API port %s:%d kept open by the keeper across the restart", host, port)
            return sock
        sock.close()  # the operator moved it, or wants no workers: the old port closes now
        self._keeper_stale = True  # the keeper holds it too: it gets a fresh keeper after the load
        return None

    def _load(self, notify: Callable[[dict], None], found: tuple[KeeperLink, Kept] | None, copying: CopyPlan | None) -> None:
        o, r = self.opts, self.r
        self.state = "loading"
        if found is not None and self._readopt(*found):
            return
        log.info("loading %s (quant %s, %s, %s)", r.model, o.quant, r.dtype, r.device)
        last = [0.0]

        def on_progress(p: Progress) -> None:
            if time.monotonic() - last[0] > 0.2:
                last[0] = time.monotonic()
                notify({"progress": p.done_bytes, "total": p.total_bytes})
                systemd.notify(STATUS=f"loading: {p.done_bytes / 2**30:.2f} of {p.total_bytes / 2**30:.2f} GiB")

        if found is not None:  # the keeper's weights proved not ours: not planned before
            copying = copy_plan(r.model, o.quant, r.dtype, r.transport, r.device)
        copies, seconds = [], 0.0
        try:
            for k, device in enumerate(r.devices):  # (one after another: each later one reads the page cache)
                if k:
                    self.progress = Progress()
                    copying = copying and copy_plan(r.model, o.quant, r.dtype, r.transport, device)
                    log.info("loading the copy of data-parallel rank %d on %s", k, device)
                copies.append(self._load_copy(device, copying, on_progress))
                seconds += self.progress.seconds
        except BaseException:
            for copy in copies:
                copy.arena.close()  # (no half-made set of copies left behind)
            raise
        self.progress.seconds = seconds
        self._loaded(copies)
        log.info("loaded in %.3f s", seconds)  # (a start's timeline: what the first worker waits for, with the zygote)

    def _load_copy(self, device: str, copying: CopyPlan | None, on_progress) -> Loaded:
        o, r = self.opts, self.r
        if copying is not None:
            loaded = load_copied(r.model, o.quant, r.dtype, device, r.transport, self.progress, on_progress, copying)
            if loaded is not None:
                return loaded
        import torch  # quantized or converted: the loader that computes, with torch

        from preload.preloadd.loader import load

        return load(r.model, o.quant, getattr(torch, r.dtype), torch.device(device), r.transport, self.progress,
                    on_progress)

    def _readopt(self, link: KeeperLink, kept: Kept) -> bool:
        """Own the weights a keeper held through a crash, if they are what we would load
        (else release them first: never two copies); True if we do."""
        o, r = self.opts, self.r
        try:
            if len(kept.manifests) != len(r.devices):
                raise ValueError(f"{len(kept.manifests)} copies, not one for each of {len(r.devices)} data-parallel ranks")
            manifests = [kept_manifest(wire, r.model, o.quant, r.dtype, device, r.transport)
                         for wire, device in zip(kept.manifests, r.devices)]
        except (LoadError, ValueError) as e:
            log.warning("the keeper (pid %d) holds other weights: %s; letting them go and loading", link.pid, e)
            link.release()
            kept.close()
            return False
        copies = [Loaded(HeldArena(m.arena, fds), m) for m, fds in zip(manifests, kept.arena_fds)]
        kept.arena_fds = []
        p = self.progress
        p.total_bytes = p.done_bytes = sum(copy.arena.size for copy in copies)
        p.tensors_total = p.tensors_done = sum(len(m.layout.name) for m in manifests)
        p.seconds = time.monotonic() - p.started
        self._loaded(copies)
        self.readopted = True
        if o.keeper:
            self.keeper = link  # it goes on holding, for the next crash
        else:
            link.release()  # we hold our own fds now
        log.info("took back %d bytes of weights from the keeper (pid %d) in %.3f s, without reading the checkpoint",
                 p.total_bytes, link.pid, p.seconds)
        return True

    def _loaded(self, copies: list[Loaded]) -> None:
        self.copies = copies
        self.metrics.load_seconds.set(self.progress.seconds)
        for device, size in self._bytes_per_device().items():
            self.metrics.resident_bytes.labels(device).set(size)

    def _bytes_per_device(self) -> dict[str, int]:
        sizes = dict.fromkeys(self.r.devices, 0)
        for device, copy in zip(self.r.devices, self.copies):
            sizes[device] += copy.arena.size
        return sizes

    def _on_error(self) -> None:
        self.errors += 1
        self.metrics.errors.inc()

    def _install_signal_handlers(self) -> None:
        def stop(signum, _frame):
            log.info("received %s", signal.Signals(signum).name)
            self.stop_requested.set()
            self.sleeper.poke.set()
            if self.state in ("starting", "loading"):  # (loading lasts until every worker is ready)
                self.progress.cancelled.set()  # the loader's threads end at their next chunk
                raise KeyboardInterrupt  # abandon the start; run()'s cleanup still happens

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
