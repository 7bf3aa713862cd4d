"""`preload start`, `preload status`, `preload stop`: the daemon's lifecycle from a shell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from preload.ipc.protocol import default_state_dir

QUANTS = ("none", "fp8_per_tensor", "fp8_block")
state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Daemon state dir [default: $XDG_RUNTIME_DIR/preload, else /tmp/preload-$UID].",
)


def _state_dir(value: Path | None) -> Path:
    return (value or default_state_dir()).absolute()


@click.command()
@click.option("--model", type=click.Path(path_type=Path), default=None, help="Checkpoint dir [default: the bundled model].")
@click.option("--quant", type=click.Choice(QUANTS), default="none", show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True,
              help="Dtype of unquantized weights: bf16 on CUDA, the checkpoint's on CPU.")
@click.option("--transport", type=click.Choice(["auto", "memfd"]), default="auto", show_default=True,
              help="How workers map the arena: memfd (host memory).")
@state_dir_option
@click.option("--health-host", default="127.0.0.1", show_default=True)
@click.option("--health-port", type=click.IntRange(0, 65535), default=8001, show_default=True)
@click.option("--allow-uid", type=int, multiple=True, help="Also let this uid attach (repeatable).")
@click.option("--allow-gid", type=int, multiple=True, help="Also let members of this gid attach (repeatable).")
@click.option("--foreground", is_flag=True, help="Run in this process instead of returning once ready.")
@click.option("--notify-fd", type=int, default=None, hidden=True)
def start(model, quant, device, dtype, transport, state_dir, health_host, health_port, allow_uid, allow_gid, foreground, notify_fd):
    """Load a checkpoint once and keep its weights resident for workers to attach."""
    state_dir = _state_dir(state_dir)
    if not foreground:
        args = ["--quant", quant, "--device", device, "--dtype", dtype, "--transport", transport,
                "--state-dir", str(state_dir), "--health-host", health_host, "--health-port", str(health_port)]
        args += ["--model", str(Path(model).absolute())] if model else []
        args += [a for uid in allow_uid for a in ("--allow-uid", str(uid))]
        args += [a for gid in allow_gid for a in ("--allow-gid", str(gid))]
        sys.exit(_start_in_background(args, state_dir))
    sys.exit(_run_foreground(model, quant, device, dtype, transport, state_dir, health_host, health_port,
                             set(allow_uid), set(allow_gid), notify_fd))


def _run_foreground(model, quant, device, dtype, transport, state_dir, health_host, health_port, uids, gids, notify_fd) -> int:
    import logging

    from preload import BUNDLED_MODEL
    from preload.preloadd.daemon import Daemon, DaemonOptions
    from preload.worker.config import ModelConfig
    from preload.worker.llm import resolve_device, resolve_dtype

    notify = _notifier(notify_fd)
    os.umask(0o077)  # sockets, logs and lock: owner only
    try:
        model = Path(model or BUNDLED_MODEL).absolute()
        dev = resolve_device(device)
        cfg = ModelConfig.from_dir(model)
        options = DaemonOptions(
            model=model,
            quant=quant,
            device=dev,
            dtype=resolve_dtype(None if dtype == "auto" else dtype, dev, cfg),
            transport="memfd" if transport == "auto" else transport,
            state_dir=state_dir,
            health_host=health_host,
            health_port=health_port,
            allow_uids=uids,
            allow_gids=gids,
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
    cmd = [sys.executable, "-m", "preload.cli.main", "start", *args, "--foreground", "--notify-fd", str(write_fd)]
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
                click.echo(f"preload daemon ready (pid {msg['pid']}) in {msg['seconds']:.2f} s on {state_dir}")
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

    state_dir = _state_dir(state_dir)
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


@click.command()
@state_dir_option
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait for the daemon to exit.")
def stop(state_dir, timeout):
    """Stop the daemon; its weights are freed once the last attached worker lets go."""
    from preload.ipc.client import DaemonClient, DaemonUnavailable

    state_dir = _state_dir(state_dir)
    try:
        with DaemonClient(state_dir, timeout=5) as client:
            pid = client.request("status")["status"]["pid"]
            client.request("shutdown")
    except DaemonUnavailable:
        click.echo(f"no preload daemon running on {state_dir}")
        return
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            click.echo(f"preload: daemon pid {pid} did not exit within {timeout:.0f} s", err=True)
            sys.exit(1)
        time.sleep(0.05)
    click.echo(f"preload daemon (pid {pid}) stopped")


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
