"""`preload start`: load a checkpoint once and keep it resident, then return once ready.

Without --foreground the daemon is a detached process (its own session) that reports
its progress and its ready (or error) line back through a pipe; `preload start` exits 0
once it is ready, or non-zero with the daemon's error on stderr.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from logging.handlers import RotatingFileHandler
from pathlib import Path

import click

from preload.checkpoint.pages import read_in
from preload.cli.options import build, options_of
from preload.ipc import protocol
from preload.ipc.devices import cuda_device_count, ordinal
from preload.options import BUNDLED_MODEL, DaemonOptions
from preload.preloadd.keeper import KEEPER_SOCK
from preload.preloadd.state_dir import StateDirError, prepare_state_dir
from preload.preloadd.zygote import Zygote, launch_early

log = logging.getLogger("preload.daemon")
LOG_BYTES, LOG_BACKUPS = protocol.LOG_BYTES, protocol.LOG_BACKUPS  # daemon.log, then .1 .. .3


@click.command()
@click.argument("model_dir", metavar="[MODEL]", required=False, type=click.Path(path_type=Path))
@options_of(DaemonOptions)
@click.option("--foreground", is_flag=True, help="Run in this process instead of returning once ready.")
def start(model_dir, foreground, **params):
    """Load the checkpoint MODEL (a directory; or --model, as `vllm serve MODEL` takes
    either) once, keep its weights resident, and serve it with --workers engine workers."""
    if model_dir is not None:
        if params["model"] is not None and params["model"] != model_dir:
            raise click.UsageError(f"two models: MODEL {model_dir} and --model {params['model']}; give one")
        params["model"] = model_dir
    options = build(DaemonOptions, params, create_state_dir=True)
    try:  # before anything is written there: a state dir is ours, or nothing happens
        prepare_state_dir(options.state_dir, bool(options.allow_uid or options.allow_gid))
    except StateDirError as e:
        raise click.ClickException(str(e)) from None
    sys.exit(run_daemon(options) if foreground else _start_in_background(options))


def run_daemon(options: DaemonOptions, notify_fd: int | None = None) -> int:
    if not (options.state_dir / KEEPER_SOCK).exists():  # (else a keeper likely holds the weights: no read follows)
        read_ahead(Path(options.model or BUNDLED_MODEL))  # first: the imports below take a second or more
    from setproctitle import setproctitle

    setproctitle(f"preload daemon --state-dir {options.state_dir}")  # what `ps` shows (its argv is JSON)
    notify = _notifier(notify_fd)
    os.umask(0o077)  # sockets, logs and lock: owner only
    zygote = None
    try:  # (`start` checked the state dir)
        _log_to(options.state_dir / "daemon.log", to_stderr=notify_fd is None)
    except OSError as e:  # nowhere to log to: said to the operator, no traceback
        return _failed(f"preload: the daemon's log: {e.strerror}", notify, notify_fd)
    try:
        if options.restore is not None:  # the daemon's imports beside the restore (0.1 s), not after it
            threading.Thread(target=importlib.import_module, args=("preload.preloadd.daemon",), name="imports",
                             daemon=True).start()  # (an import that fails there fails again below, and is said)
        if options.workers and options.zygote:  # its imports are a first worker's longest wait: they begin now
            zygote = first_zygote(options)
        elif options.restore is not None:
            log.warning("--restore %s: not used, no zygote runs (--workers 0 or --no-zygote)", options.restore)
        if options.device != "cpu":  # the CUDA driver's start (0.2 s on an H200 host) overlaps the imports too
            threading.Thread(target=_start_cuda, args=(options,), name="cuinit", daemon=True).start()
        from preload.preloadd.daemon import Daemon  # torch and the rest: a broken install is a failed start too

        Daemon(options, zygote).run(notify)
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line for the operator; the traceback goes to the log
        log.error("start failed: %s", e, exc_info=True)
        return _failed(f"preload: {e}", notify, notify_fd)
    finally:
        if zygote is not None:
            zygote.discard()  # (reaped already, unless the start failed before its supervisor took it)


def first_zygote(options: DaemonOptions) -> Zygote:
    """The zygote of --restore's snapshot, or one launched now; `restore` says which (and why)."""
    t0, why = time.monotonic(), None
    if options.restore is not None:
        from preload.preloadd import snapshot

        try:
            zygote = snapshot.restore(options.restore, options.state_dir)
            zygote.restore = {"from": str(options.restore), "restored": True, "seconds": round(time.monotonic() - t0, 3)}
            log.info("zygote restored from %s (pid %d) in %.3f s: its imports done", options.restore, zygote.pid,
                     time.monotonic() - t0)
            return zygote
        except snapshot.SnapshotError as e:
            why = str(e)
            log.warning("--restore %s: %s; a zygote is launched instead", options.restore, why)
    zygote = launch_early(options.state_dir)
    zygote.restore = None if why is None else {"from": str(options.restore), "restored": False, "why": why}
    log.info("zygote launched (pid %d): its imports overlap the daemon's start and load", zygote.pid)
    return zygote


def _failed(message: str, notify, notify_fd: int | None) -> int:
    """A failed start, said once: to the waiting `preload start`, or here in the foreground."""
    notify({"error": message})
    if notify_fd is None:
        click.echo(message, err=True)
    return 1


def _start_cuda(options: DaemonOptions) -> None:
    """The driver's start, and the compiles of the kernels a load into GPU memory uses
    (0.13 s each on an H200 host) that its plan would otherwise wait for: all beside the
    daemon's imports."""
    from preload.ipc import finite_device, fp8_device  # (numpy: not on the way to the zygote's launch)

    cuda_device_count()
    if options.transport in ("auto", "cuda-vmm"):  # (auto is cuda-vmm on a GPU)
        finite_device.available(ordinal(options.device))
    if options.quant == "fp8_block":
        fp8_device.available(ordinal(options.device))


def read_ahead(model_dir: Path) -> None:
    """Have the checkpoint's files read into the page cache now, in the background, while
    the daemon imports torch and the rest (needing no torch, this can start before them):
    a load from a cold disk then finds much of it there. Warm, it only maps pages."""

    def run() -> None:
        for path in sorted(model_dir.glob("*.safetensors")):
            try:
                read_in(path)
            except OSError:
                continue  # the load will say what is wrong with it

    threading.Thread(target=run, name="read-ahead", daemon=True).start()


def _log_to(path: Path, to_stderr: bool) -> None:
    # Rotated: a daemon runs for months. (What its stderr gets, a crash at import, stays in
    # the file it was opened on.)
    handlers: list[logging.Handler] = [OwnRotatingLog(path, maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS)]
    if to_stderr:
        handlers.append(logging.StreamHandler())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", handlers=handlers, force=True)


class OwnRotatingLog(RotatingFileHandler):
    """The daemon's log, opened (and reopened after each rotation) never through a symbolic
    link: a link planted as daemon.log is refused, not written through."""

    def _open(self):
        fd = protocol.open_own(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        return os.fdopen(fd, self.mode, encoding=self.encoding, errors=self.errors)


def _notifier(fd: int | None):
    """Progress and the final ready/error line go to the parent `preload start`, if any."""
    if fd is None:
        return lambda msg: None
    pipe = os.fdopen(fd, "w", buffering=1)

    def notify(msg: dict) -> None:
        try:
            pipe.write(json.dumps(msg) + "\n")
        except BrokenPipeError:
            pass  # the parent gave up waiting; keep serving

    return notify


def _start_in_background(options: DaemonOptions) -> int:
    state_dir = options.state_dir
    log_path = state_dir / "daemon.log"
    read_fd, write_fd = os.pipe()
    # The daemon's own stderr goes to its log, so that even a crash at import is on record.
    try:
        log_fd = protocol.open_own(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    except OSError as e:
        raise click.ClickException(f"the daemon's log: {e.strerror}") from None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()  # (this process has no threads yet, and imports no torch: safe to fork)
    if pid == 0:
        # The daemon: this process, detached (its own session; stdin /dev/null; stdout and
        # stderr its log). A fork rather than a fresh interpreter: the interpreter's start and
        # the command line's imports are done already (0.1-0.2 s of a restart's second).
        code = 1
        try:
            os.setsid()
            os.close(read_fd)
            null = os.open(os.devnull, os.O_RDONLY)
            for fd, target in ((0, null), (1, log_fd), (2, log_fd)):
                os.dup2(target, fd)
            os.close(null)
            os.close(log_fd)
            code = run_daemon(options, write_fd)
        except BaseException:  # noqa: BLE001 - the daemon's own end: on record, then out
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write_fd)
    os.close(log_fd)
    import psutil

    began = psutil.Process().create_time()  # "ready in": from this command's start, interpreter and imports included
    bar = None
    with os.fdopen(read_fd) as pipe:
        for line in pipe:
            msg = json.loads(line)
            if "progress" in msg and sys.stderr.isatty():
                if bar is None:
                    from tqdm import tqdm

                    bar = tqdm(total=msg["total"], unit="B", unit_scale=True, desc="loading", file=sys.stderr)
                bar.update(msg["progress"] - bar.n)
            elif "ready" in msg:
                if bar:
                    bar.close()
                click.echo(ready_line(msg, time.time() - began, state_dir, options.host))
                return 0
            elif "error" in msg:
                if bar:
                    bar.close()
                click.echo(msg["error"], err=True)
                os.waitpid(pid, 0)
                return 1
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code == 130:  # (its SIGTERM/SIGINT handler: `preload stop` or a signal while it started)
        click.echo(f"preload: the daemon was stopped before it was ready (pid {pid})", err=True)
    else:
        click.echo(f"preload: the daemon exited with status {code} before it was ready; see {log_path}", err=True)
    return 1



def ready_line(msg: dict, seconds: float, state_dir: Path, host: str) -> str:
    """What `preload start` prints once ready: where the API answers (or that no worker
    serves one), and where the daemon is."""
    n = msg.get("workers") or 0
    where = f"http://{'[' + host + ']' if ':' in host else host}:{msg['port']}/v1"
    serving = f"serving {where} ({n} worker{'s' if n != 1 else ''})" if n else "holding the weights only (--workers 0)"
    return (f"preload daemon ready (pid {msg['pid']}) in {seconds:.2f} s (weights loaded in {msg['seconds']:.2f} s), "
            f"{serving}; state dir {state_dir}, health port {msg.get('health_port')}")
