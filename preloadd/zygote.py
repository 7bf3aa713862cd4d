"""The zygote: a process that has imported torch and the worker code, never touched
CUDA, and forks ready-to-attach workers on request (its body: zygote_process.py); here,
the daemon's handle on it, and what both sides share.

A fresh Python spends seconds importing torch before it can do anything; a fork of
this process starts where those imports left off. Each worker is double-forked so
that it is orphaned at once and adopted by the daemon (a child subreaper), which
then reaps it and sees its exit status, whether or not the zygote still lives.

Every worker gets its own link to the daemon: one end of a SOCK_SEQPACKET socketpair
(the daemon's end travels back over SCM_RIGHTS). The daemon says on it which slot the
worker is to serve (at once, or later for a spare); the worker reports on it (warm,
ready, heartbeats). See worker/link.py for the messages.

Protocol on the zygote's own SOCK_SEQPACKET socketpair (one JSON message each way):
  daemon -> zygote  {"spec": ..., "env": {...}} + the API's listening socket (SCM_RIGHTS),
                    once: what every worker is started with; read after the imports
  zygote -> daemon  {"ready": true, ...} once its imports are done and it has the spec
  daemon -> zygote  {"slot": k, "role": r}          fork a worker for slot k (or a spare: null), a core
                                                    or a front (worker/serve.py)
  zygote -> daemon  {"pid": p} + the daemon's end of the worker's link (SCM_RIGHTS)
It exits when the daemon closes its end. The spec comes apart from the launch so that a cold
start's first zygote can be launched before the daemon has imported, bound its ports or
planned its load (cli/start.py): its imports are a cold start's longest wait (6 s, H200).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

from preload.options import ServeOptions, to_json
from preload.preloadd.install import code_version, uncompiled_imports
from preload.preloadd.state_dir import KERNEL_CACHE_ENV, METRICS_DIR, MULTIPROC_ENV
from preload.preloadd.workers import MAX_BACKOFF, unregister

IMPORTS_TIMEOUT = 120.0  # a start's wait for the imports, if --worker-start-timeout is shorter (a loaded host)
FORK_TIMEOUT = 10.0  # seconds for the zygote to answer a fork request; a zygote that does not is replaced
CODE_CHECK_INTERVAL = 2.0  # seconds between looks at whether the installed code changed
WORKER_ENV = (KERNEL_CACHE_ENV, MULTIPROC_ENV)  # set by the daemon for its workers (daemon.py)
# numpy (imported by torch) starts an OpenBLAS thread per core at its import; a process that
# forks must have no threads. torch's own matrix products do not use numpy's OpenBLAS.
ZYGOTE_ENV = {"OPENBLAS_NUM_THREADS": "1"}

log = logging.getLogger("preload.daemon")


def log_name(slot: int | None, role: str = "core") -> str:
    """A worker's log in the state dir: a slot's core (`worker-N.log`, as before there were
    fronts), its front (`front-N.log`), or the spares'."""
    if slot is None:
        return "spares.log"
    return f"front-{slot}.log" if role == "front" else f"worker-{slot}.log"


def send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(msg).encode()], list(fds))


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the fds that came with it; None when the other end closed."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
    return (json.loads(data) if data else None), fds


def link_pair() -> tuple[socket.socket, socket.socket]:
    """(the daemon's end, the worker's end) of a worker's link."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


# ---- in the daemon --------------------------------------------------------------------------


def launch_early(state_dir: Path) -> Zygote:
    """A cold start's first zygote, launched before the daemon imports anything heavy
    (cli/start.py)."""
    return Zygote(state_dir, code_version())


def environment(state_dir: Path) -> dict[str, str]:
    """What a zygote of `state_dir` imports with: our environment, ZYGOTE_ENV, and its
    workers' metrics dir (prometheus-client decides at its import whether it writes its
    series to files: set before it, even where the daemon has not set its own yet)."""
    return os.environ | ZYGOTE_ENV | {MULTIPROC_ENV: str(state_dir / METRICS_DIR)}


def worker_spec(serve: ServeOptions, gpu: bool = False, model: Path | None = None) -> dict:
    """What every worker is started with (its slot is added per worker); `gpu`: the workers run
    on a GPU, and the zygote imports their Triton kernels ahead; `model`: the fronts' tokenizer."""
    return {"serve": to_json(serve), "gpu": gpu, "tokenizer": None if model is None else str(Path(model).absolute())}


class Zygote:
    """The daemon's handle on a zygote process. It is launched at once and spends
    seconds importing; `configure` gives it what its workers start with; its `sock`
    becomes readable when it is ready (`accept_ready`). It imports with `environment`."""

    restore: dict | None = None  # a start's first zygote with --restore: from the snapshot, or why not (cli/start.py)

    def __init__(self, state_dir: Path, version: str, park: str | None = None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [sys.executable, "-m", "preload.preloadd.zygote_process", str(state_dir), str(theirs.fileno())]
        try:  # (`park`: to be dumped after its "imports" or also the "kernels" (snapshot.py); CRIU takes a
            # process that leads its own session)
            self.proc = subprocess.Popen(cmd + (["--park", park] if park else []), pass_fds=(theirs.fileno(),),
                                         env=environment(state_dir), start_new_session=bool(park))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._took(ours, version)

    @classmethod
    def restored(cls, proc, sock: socket.socket, version: str) -> Zygote:
        """A zygote that CRIU restored from a snapshot (snapshot.py), `proc` its process."""
        z = cls.__new__(cls)
        z.proc = proc
        z._took(sock, version)
        return z

    def _took(self, sock: socket.socket, version: str) -> None:
        self.sock = sock
        self.pidfd = os.pidfd_open(self.proc.pid)  # readable once it has exited
        self.version = version  # of the code it imported
        self.ready = False
        self.launched, self.ready_at = time.time(), 0.0  # (the wall clock, as the zygote's "at")

    def configure(self, spec: dict, listen_fd: int) -> None:
        """What every worker is started with, and the environment they need (WORKER_ENV,
        as the daemon has it now): queued in the socket until the imports are done."""
        send(self.sock, {"spec": spec, "env": {k: os.environ[k] for k in WORKER_ENV if k in os.environ}}, [listen_fd])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def accept_ready(self) -> bool:
        """Read the zygote's ready message (call once `sock` is readable); False if it died instead."""
        ready, _ = receive(self.sock)
        self.ready = bool(ready)
        if self.ready:
            at = ready.get("at")
            self.ready_at = at if isinstance(at, float) and self.launched <= at <= time.time() else time.time()
        return self.ready

    def fork(self, slot: int | None, role: str = "core", dp_rank: int = 0) -> tuple[int, socket.socket]:
        """A new worker's pid and the daemon's end of its link."""
        self.sock.settimeout(FORK_TIMEOUT)
        try:
            send(self.sock, {"slot": slot, "role": role, "dp_rank": dp_rank})
            reply, fds = receive(self.sock)
        except OSError as e:  # a timeout included: a zygote that cannot fork is as good as dead
            raise RuntimeError(f"the zygote (pid {self.pid}) did not fork: {e}") from None
        if not reply or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"the zygote (pid {self.pid}) died")
        return reply["pid"], socket.socket(fileno=fds[0])

    def retire(self) -> None:
        """Let it go: it exits when its channel closes. Its exit is reaped by whoever
        watches `proc` (the supervisor, through `proc.poll()`)."""
        self.sock.close()

    def close(self) -> None:
        """Once it has been reaped."""
        self.sock.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def discard(self) -> None:
        """Kill, reap and close it, unless that was done already: a zygote launched for a
        start that failed before its supervisor took it over."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.close()


class Zygotes:
    """The daemon's zygotes: the one that forks (`ready`), a new one importing
    (`pending`: at start, after the last one died, or when the installed code changed),
    and old ones exiting (`retired`). Driven by the supervisor's loop: each zygote's
    pidfd and a pending one's socket are registered with the loop's selector."""

    def __init__(self, spec: dict, listen_fd: int, state_dir: Path, early: Zygote | None = None):
        self.spec, self.listen_fd, self.state_dir = spec, listen_fd, state_dir
        self._early = early  # launched before the daemon had its spec (cli/start.py): the first to start
        self.ready: Zygote | None = None
        self.pending: Zygote | None = None
        self.retired: list[Zygote] = []
        self.restarts = 0  # zygotes that took over from an earlier one
        self.error: str | None = None  # the first zygote died before its imports were done
        self._had_one = False  # a zygote has been ready before
        self._failures = 0
        self._next_start = 0.0  # backoff after a zygote died before it was ready
        self._code_checked = time.monotonic()
        if uncompiled := uncompiled_imports():
            log.warning("no cached bytecode for %s, and this Python writes none: every interpreter compiles those"
                        " modules again, seconds of each cold start and zygote renewal (`python -m compileall` over"
                        " them once, into PYTHONPYCACHEPREFIX where that is set, ends that)", " and ".join(uncompiled))

    def pids(self) -> set[int]:
        return {z.pid for z in (self.ready, self.pending, *self.retired) if z is not None}

    def start(self, sel: selectors.BaseSelector) -> None:
        z, self._early = self._early or Zygote(self.state_dir, code_version()), None
        z.configure(self.spec, self.listen_fd)
        self.pending = z
        sel.register(z.pidfd, selectors.EVENT_READ, lambda: self._exited(sel, z))
        sel.register(z.sock, selectors.EVENT_READ, lambda: self._ready(sel, z))

    def fork(self, slot: int | None, role: str = "core", dp_rank: int = 0) -> tuple[int, socket.socket]:
        if self.ready is None:
            raise RuntimeError("no zygote is ready")
        try:
            return self.ready.fork(slot, role, dp_rank)
        except RuntimeError:
            self._retire(self.ready, kill=True)
            raise

    def check(self, sel: selectors.BaseSelector) -> None:
        """Start a zygote if none is ready (after a backoff), or a new one if the code changed."""
        if self.pending is not None or self.error:
            return
        if self.ready is None:
            if time.monotonic() >= self._next_start:
                self.start(sel)
        elif time.monotonic() - self._code_checked > CODE_CHECK_INTERVAL:
            self._code_checked = time.monotonic()
            if code_version() != self.ready.version:
                log.info("installed code changed; renewing the zygote")
                self.start(sel)

    def current(self, sel: selectors.BaseSelector) -> bool:
        """Whether forks run the code installed now (a restart waits for that)."""
        if self.pending is None and self.ready is not None and code_version() != self.ready.version:
            log.info("installed code changed; renewing the zygote before restarting")
            self.start(sel)
        return self.pending is None and self.ready is not None

    def stop(self) -> None:
        if self._early is not None:  # never started: the daemon stopped before its supervisor did
            self._early.discard()
        for z in (self.ready, self.pending, *self.retired):
            if z is not None:
                z.retire()
                if z is self.pending:  # still importing, or just done: it has forked nothing
                    z.proc.kill()
                try:
                    z.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:  # a zygote that does not exit on EOF is killed
                    z.proc.kill()
                    z.proc.wait()
                z.close()

    def _ready(self, sel: selectors.BaseSelector, z: Zygote) -> None:
        unregister(sel, z.sock)
        if z.sock.fileno() < 0 or not z.accept_ready():
            return  # it died instead: its pidfd says so
        old, self.ready, self.pending = self.ready, z, None
        self._failures = 0
        if self._had_one:
            self.restarts += 1
            log.info("zygote ready (pid %d), replacing one that %s", z.pid, "was outdated" if old else "died")
        else:  # (on a cold start's path: a worker forks from it once the load is done, and it is ready)
            log.info("zygote ready (pid %d) %.3f s after its launch, seen %.3f s later", z.pid, z.ready_at - z.launched,
                     time.time() - z.ready_at)
        self._had_one = True
        if old is not None:
            self._retire(old)

    def _retire(self, z: Zygote, kill: bool = False) -> None:
        """Stop using a zygote; it exits (killed, if it no longer answers) and is reaped later."""
        if self.ready is z:
            self.ready = None
        z.retire()
        if kill:
            z.proc.kill()
        self.retired.append(z)

    def _exited(self, sel: selectors.BaseSelector, z: Zygote) -> None:
        if z.proc.poll() is None:  # reaped by its own pid: its exit status is its own
            return
        unregister(sel, z.pidfd)
        unregister(sel, z.sock)
        z.close()
        if z in self.retired:
            self.retired.remove(z)
            return
        log.warning("zygote (pid %d) exited with status %s; starting a new one", z.pid, z.proc.returncode)
        if self.ready is z:
            self.ready = None
        if self.pending is z:
            self.pending = None
            self._failures += 1
            if not self._had_one:  # it never got as far as its imports: the next one would not either
                self.error = f"the zygote exited with status {z.proc.returncode} before it was ready"
        f = self._failures
        self._next_start = time.monotonic() + (min(0.5 * 2 ** (f - 1), MAX_BACKOFF) if f else 0.0)


def spawn_fresh(spec: dict, slot: int | None, listen_fd: int, role: str = "core",
                dp_rank: int = 0) -> tuple[subprocess.Popen, socket.socket]:
    """Without a zygote: a worker as a new interpreter that imports everything itself."""
    ours, theirs = link_pair()
    log_path = f"{spec['serve']['state_dir']}/{log_name(slot, role)}"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "preload.preloadd.zygote_process", "--worker",
             json.dumps(spec | {"slot": slot, "role": role, "dp_rank": dp_rank}),
             str(listen_fd), str(theirs.fileno()), log_path],
            pass_fds=(listen_fd, theirs.fileno()), start_new_session=True)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours
