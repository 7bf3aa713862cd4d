"""`preload start`, `preload status`, `preload stop`: the daemon's lifecycle from a shell."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from preload.cli.options import engine_options, serve_options, state_dir_option, state_dir_path

QUANTS = ("none", "fp8_per_tensor", "fp8_block")

@click.command()
@click.option("--model", type=click.Path(path_type=Path), default=None, help="Checkpoint dir [default: the bundled model].")
@click.option("--quant", type=click.Choice(QUANTS), default="none", show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True,
              help="Dtype of unquantized weights: bf16 on CUDA, the checkpoint's on CPU.")
@click.option("--transport", type=click.Choice(["auto", "memfd", "cuda-vmm", "cuda-ipc"]), default="auto", show_default=True,
              help="How workers map the arena: memfd (host memory), cuda-vmm (GPU, read-only maps; the CUDA default), cuda-ipc (legacy).")
@state_dir_option
@click.option("--health-host", default="127.0.0.1", show_default=True)
@click.option("--health-port", type=click.IntRange(0, 65535), default=8001, show_default=True)
@click.option("--allow-uid", type=int, multiple=True, help="Also let this uid attach (repeatable).")
@click.option("--allow-gid", type=int, multiple=True, help="Also let members of this gid attach (repeatable).")
@click.option("--workers", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Engine workers to run and supervise (0: hold the weights only).")
@click.option("--host", default="127.0.0.1", show_default=True, help="API host of the workers.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="API port, owned by the daemon.")
@click.option("--no-zygote", is_flag=True, help="Start workers as fresh processes instead of forking them (slower).")
@click.option("--spare-workers", type=click.IntRange(0, 8), default=None,
              help="Warm spare workers that take over a dead worker's slot at once [default: 1 on a GPU, 0 on CPU].")
@engine_options
@click.option("--foreground", is_flag=True, help="Run in this process instead of returning once ready.")
@click.pass_context
def start(ctx, foreground, **params):
    """Load a checkpoint once and keep its weights resident for workers to attach."""
    if not foreground:
        sys.exit(_start_in_background(_as_args(ctx.command, params), state_dir_path(params["state_dir"])))
    sys.exit(run_daemon(params))


def _as_args(command: click.Command, params: dict) -> list[str]:
    """The command-line flags that reproduce `params` (for the detached daemon)."""
    args = []
    for p in command.params:
        value = params.get(p.name)
        if not isinstance(p, click.Option) or value is None or p.name == "foreground":
            continue
        flag = p.opts[0]
        if p.is_flag:
            args += [flag] if value else []
        elif p.multiple:
            args += [a for v in value for a in (flag, str(v))]
        else:
            args += [flag, str(value)]
    return args


def run_daemon(params: dict, notify_fd: int | None = None) -> int:
    import logging

    from preload import BUNDLED_MODEL
    from preload.ipc.arena import default_transport
    from preload.preloadd.daemon import Daemon, DaemonOptions
    from preload.worker.config import ModelConfig
    from preload.worker.llm import resolve_device, resolve_dtype
    from preload.worker.serve import spec_of

    notify = _notifier(notify_fd)
    os.umask(0o077)  # sockets, logs and lock: owner only
    p = params
    state_dir = state_dir_path(p["state_dir"])
    try:
        model = Path(p["model"] or BUNDLED_MODEL).absolute()
        dev = resolve_device(p["device"])
        spares = p["spare_workers"] if p["spare_workers"] is not None else int(dev.type == "cuda" and p["workers"] > 0)
        cfg = ModelConfig.from_dir(model)
        options = DaemonOptions(
            model=model,
            quant=p["quant"],
            device=dev,
            dtype=resolve_dtype(None if p["dtype"] == "auto" else p["dtype"], dev, cfg),
            transport=default_transport(dev) if p["transport"] == "auto" else p["transport"],
            state_dir=state_dir,
            health_host=p["health_host"],
            health_port=p["health_port"],
            allow_uids=set(p["allow_uid"]),
            allow_gids=set(p["allow_gid"]),
            workers=p["workers"],
            api_host=p["host"],
            api_port=p["port"],
            worker_spec=spec_of(serve_options(state_dir, None, p["host"], p["port"], p)) | {"workers": p["workers"], "spares": spares},
            use_zygote=not p["no_zygote"],
            spares=spares,
        )
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _log_to(state_dir / "daemon.log", to_stderr=notify_fd is None)
        Daemon(options).run(notify)
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line for the operator; the traceback goes to the log
        logging.getLogger("preload.daemon").debug("start failed", exc_info=True)
        message = f"preload: {e}"
        notify({"error": message})
        if notify_fd is None:
            click.echo(message, err=True)
        return 1


def _log_to(path: Path, to_stderr: bool) -> None:
    import logging

    handlers: list[logging.Handler] = [logging.FileHandler(path)]
    if to_stderr:
        handlers.append(logging.StreamHandler())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", handlers=handlers, force=True)


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


def _start_in_background(args: list[str], state_dir: Path) -> int:
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_path = state_dir / "daemon.log"
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "preload.cli.daemon", str(write_fd), *args]
    # The daemon's own stderr goes to its log, so that even a crash at import is on record.
    with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
        proc = subprocess.Popen(
            cmd, pass_fds=(write_fd,), start_new_session=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    os.close(write_fd)
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
                workers = f", {msg['workers']} workers on port {msg['port']}" if msg.get("workers") else ""
                click.echo(f"preload daemon ready (pid {msg['pid']}) in {msg['seconds']:.2f} s on {state_dir}{workers}")
                return 0
            elif "error" in msg:
                if bar:
                    bar.close()
                click.echo(msg["error"], err=True)
                proc.wait()
                return 1
    code = proc.wait()
    click.echo(f"preload: the daemon exited with status {code} before it was ready; see {log_path}", err=True)
    return 1


@click.command()
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the full status as JSON.")
def status(state_dir, as_json):
    """Show what the daemon holds and who is attached."""
    from preload.ipc.client import DaemonClient, DaemonUnavailable

    state_dir = state_dir_path(state_dir)
    try:
        with DaemonClient(state_dir, timeout=5) as client:
            s = client.request("status")["status"]
    except DaemonUnavailable as e:
        click.echo(f"preload: {e}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    gib = sum(s["bytes_per_device"].values()) / 2**30
    click.echo(f"{s['state']}: {s['model']} ({s['quant']}, {s['dtype']}) on {s['device']} via {s['transport']}")
    click.echo(f"  {gib:.3f} GiB resident, fingerprint {s['fingerprint']}")
    click.echo(f"  pid {s['pid']}, up {s['uptime_s']:.0f} s, loaded in {s['load_seconds']:.2f} s, attached: {s['attached_workers'] or 'none'}")
    for w in s["workers"]:
        click.echo(f"  worker {w['slot']}: {w['state']}, pid {w['pid']}, up {w['uptime_s']:.0f} s, "
                   f"KV cache {w['kv_cache_bytes'] / 2**30:.2f} GiB, {w['restarts']} restarts, last exit: {w['last_exit'] or '-'}")
    for w in s["spares"]:
        click.echo(f"  spare: {w['state']}, pid {w['pid']}, up {w['uptime_s']:.0f} s")


@click.command()
@state_dir_option
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait for the daemon to exit.")
def stop(state_dir, timeout):
    """Stop the daemon; its weights are freed once the last attached worker lets go."""
    from preload.ipc.client import DaemonClient, DaemonUnavailable

    state_dir = state_dir_path(state_dir)
    try:
        with DaemonClient(state_dir, timeout=5) as client:
            pid = client.request("status")["status"]["pid"]
            client.request("shutdown")
    except DaemonUnavailable:
        pid = lock_holder(state_dir / "daemon.lock")
        if pid is None:
            click.echo(f"no preload daemon running on {state_dir}")
            return
        click.echo(f"preload daemon (pid {pid}) does not answer; sending SIGTERM", err=True)
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            click.echo(f"preload: daemon pid {pid} did not exit within {timeout:.0f} s", err=True)
            sys.exit(1)
        time.sleep(0.05)
    click.echo(f"preload daemon (pid {pid}) stopped")


@click.command()
@state_dir_option
@click.option("--now", is_flag=True, help="Kill the workers and replace them at once, instead of a rolling restart.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for every worker to be replaced.")
def restart(state_dir, now, timeout):
    """Replace the daemon's workers: one at a time, each replacement ready before the old one drains."""
    from preload.ipc.client import DaemonClient, DaemonError, DaemonUnavailable

    state_dir = state_dir_path(state_dir)
    t0 = time.monotonic()
    try:
        with DaemonClient(state_dir, timeout=5) as client:
            before = {w["slot"]: w["pid"] for w in client.request("status")["status"]["workers"]}
            client.request("restart", now=now)
            while True:
                workers = client.request("status")["status"]["workers"]
                if all(w["pid"] not in (None, before.get(w["slot"])) and w["state"] == "ready" for w in workers):
                    break
                if time.monotonic() - t0 > timeout:
                    click.echo(f"preload: workers not all replaced within {timeout:.0f} s", err=True)
                    sys.exit(1)
                time.sleep(0.02)
    except (DaemonUnavailable, DaemonError) as e:
        click.echo(f"preload: {e}", err=True)
        sys.exit(1)
    pids = ", ".join(str(w["pid"]) for w in workers)
    click.echo(f"{len(workers)} workers replaced in {time.monotonic() - t0:.2f} s (pids {pids})")


def lock_holder(path: Path) -> int | None:
    """The pid in a daemon lock file while a live daemon holds the lock, else None."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text.isdigit() else None
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":
    # The detached daemon of `preload start`: argv is the notify fd, then start's flags.
    fd = int(sys.argv[1])
    ctx = start.make_context("preload start", sys.argv[2:])
    sys.exit(run_daemon(ctx.params, fd))
