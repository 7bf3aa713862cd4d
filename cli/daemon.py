"""`preload status`, `preload stop`, `preload restart`, `preload sleep`, `preload wake`: the
running daemon, from a shell."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import click

from preload.cli.options import state_dir_option, state_dir_path
from preload.preloadd.state_dir import lock_holder


STATUS_WAIT = 5.0  # seconds for each way of asking the daemon (control socket, then health port)
STATUS_KEYS = {"state", "model", "quant", "dtype", "device", "pid", "uptime_s", "fingerprint"}  # what a loading one shows


@click.command()
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the full status as JSON.")
def status(state_dir, as_json):
    """Show what the daemon holds and who is attached."""
    from preload.ipc.client import DaemonClient, DaemonUnavailable

    state_dir = state_dir_path(state_dir)
    if lock_holder(state_dir / "daemon.lock") is None:  # no daemon: say so at once, and what it left running
        from preload.preloadd.orphans import left_running

        left = [{"pid": p.pid, "process": " ".join(p.cmdline()).strip()} for p in left_running(state_dir)]
        if as_json:
            click.echo(json.dumps({"state": "absent", "left_running": left}, indent=2))
        else:
            click.echo(f"preload: no preload daemon runs on {state_dir}" + ("; still running:" if left else ""), err=True)
            for proc in left:
                click.echo(f"  pid {proc['pid']}: {proc['process']}", err=True)
        sys.exit(1)
    t0 = time.monotonic()
    try:
        with DaemonClient(state_dir, timeout=STATUS_WAIT) as client:
            s = client.request("status")["status"]
    except DaemonUnavailable as e:
        s = _status_over_http(state_dir)  # a daemon still loading has no control socket yet
        if s is None:
            waited = time.monotonic() - t0
            said = str(e) if waited < STATUS_WAIT else (
                f"the daemon (pid {lock_holder(state_dir / 'daemon.lock')}) holds {state_dir} but answered neither its"
                f" control socket nor its health port in {waited:.1f} s: stopped (SIGSTOP) or stalled")
            click.echo(f"preload: {said}", err=True)
            sys.exit(1)
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    if s["state"] != "ready" and not s["fingerprint"]:
        p = s.get("progress") or {}
        click.echo(f"{s['state']}: {s['model']} ({s['quant']}, {s['dtype']}) on {s['device']}, pid {s['pid']}, "
                   f"up {s['uptime_s']:.0f} s: {p.get('done_bytes', 0) / 2**30:.2f} of {p.get('total_bytes', 0) / 2**30:.2f}"
                   f" GiB read ({100 * p.get('fraction', 0):.0f}%), {p.get('tensors_done', 0)} of {p.get('tensors_total', 0)} tensors")
        return
    gib = sum(s["bytes_per_device"].values()) / 2**30
    copies = s.get("data_parallel") or []
    on = ", ".join(c["device"] for c in copies) if len(copies) > 1 else s["device"]
    click.echo(f"{s['state']}: {s['model']} ({s['quant']}, {s['dtype']}) on {on} via {s['transport']}")
    click.echo(f"  {gib:.3f} GiB resident" + (f" in {len(copies)} copies (data-parallel ranks)" if len(copies) > 1 else "")
               + f", fingerprint {s['fingerprint']}")
    click.echo(f"  pid {s['pid']}, up {s['uptime_s']:.0f} s, loaded in {s['load_seconds']:.2f} s, attached: {s['attached_workers'] or 'none'}")
    ports = f"API port {s['port']}, " if s.get("port") else ""
    click.echo(f"  {ports}health port {s.get('health_port')}")
    r = s.get("restore")
    if r:  # (--restore: snapshot.py)
        click.echo(f"  zygote restored from {r['from']} in {r['seconds']:.3f} s" if r["restored"]
                   else f"  --restore {r['from']} not used: {r['why']}")
    for w in s["workers"]:
        rank = f" (rank {w['dp_rank']})" if len(copies) > 1 else ""
        click.echo(f"  worker {w['slot']}{rank}: {w['state']}, pid {w['pid']}, up {w['uptime_s']:.0f} s, "
                   f"KV cache {w['kv_cache_bytes'] / 2**30:.2f} GiB, {w['restarts']} restarts, last exit: {w['last_exit'] or '-'}")
        f = w.get("front")
        if f:  # (its HTTP front: outlives the slot's engine cores)
            click.echo(f"    front: {f['state']}, pid {f['pid']}, up {f['uptime_s']:.0f} s, {f['restarts']} restarts,"
                       f" last exit: {f['last_exit'] or '-'}")
    for w in s["spares"]:
        rank = f" (rank {w['dp_rank']})" if len(copies) > 1 else ""
        click.echo(f"  spare{rank}: {w['state']}, pid {w['pid']}, up {w['uptime_s']:.0f} s")


def _stop_leftovers(state_dir, timeout: float, killed: int | None = None) -> None:
    """No daemon (or `killed`, the one just killed): SIGTERM what it left running (workers
    drain, then exit) and wait."""
    import psutil

    from preload.preloadd.orphans import left_running

    left = left_running(state_dir)
    gone = f"preload daemon (pid {killed}) killed" if killed else f"no preload daemon running on {state_dir}"
    if not left:
        click.echo(gone)
        return
    for p in left:
        p.terminate()
    gone, alive = psutil.wait_procs(left, timeout=timeout)
    for p in alive:
        p.kill()
    click.echo(f"{gone}; stopped what it left running: "
               f"{', '.join(str(p.pid) for p in left)}" + (f" ({len(alive)} killed after {timeout:.0f} s)" if alive else ""))


def _is_our_daemon(pid: int, state_dir) -> bool:
    """Whether `pid` is a process of our uid that runs the daemon of `state_dir` (its title
    or its command line names it): never signal a pid only because a file says so."""
    import psutil

    try:
        p = psutil.Process(pid)
        return p.uids().real == os.getuid() and f"--state-dir {state_dir} " in " ".join(p.cmdline()) + " "
    except psutil.Error:
        return False


def _status_over_http(state_dir) -> dict | None:
    """The daemon's /status from its health port (written to the state dir when bound),
    if its pid still holds the state dir's lock; else None."""
    import httpx

    from preload.preloadd.state_dir import DAEMON_FILE

    try:
        info = json.loads((state_dir / DAEMON_FILE).read_text())
    except (OSError, ValueError):
        return None
    if lock_holder(state_dir / "daemon.lock") != info.get("pid"):
        return None  # left by a daemon that is gone
    try:
        s = httpx.get(f"http://{info['health_host']}:{info['health_port']}/status", timeout=STATUS_WAIT).json()
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    # (whatever listens on that port now may not be the daemon: only its own document is read)
    return s if isinstance(s, dict) and s.get("pid") == info["pid"] and STATUS_KEYS <= s.keys() else None


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
            _stop_leftovers(state_dir, timeout)
            return
        if not _is_our_daemon(pid, state_dir):
            click.echo(f"preload: pid {pid} in {state_dir}/daemon.lock is not our daemon of that state dir; not signalled",
                       err=True)
            sys.exit(1)
        click.echo(f"preload daemon (pid {pid}) does not answer; sending SIGTERM", err=True)
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            # A stop always stops (issue 36: a daemon busy in a hopeless load carried on after
            # `stop` gave up): SIGKILL, then what it leaves (keeper, workers) as without a daemon.
            if not _is_our_daemon(pid, state_dir):
                click.echo(f"preload: daemon pid {pid} did not exit within {timeout:.0f} s", err=True)
                sys.exit(1)
            click.echo(f"preload: daemon pid {pid} did not exit within {timeout:.0f} s; killed (SIGKILL)", err=True)
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)
            _stop_leftovers(state_dir, timeout, killed=pid)
            return
        time.sleep(0.05)
    click.echo(f"preload daemon (pid {pid}) stopped")


@click.command()
@state_dir_option
@click.option("--now", is_flag=True, help="Kill the workers and replace them at once, instead of a rolling restart.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for every worker to be replaced.")
def restart(state_dir, now, timeout):
    """Replace the daemon's workers: one at a time, each replacement ready before the old one drains."""
    t0 = time.monotonic()

    def replaced(before: dict, s: dict) -> bool:
        old = {w["slot"]: w["pid"] for w in before["workers"]}
        return all(w["pid"] not in (None, old.get(w["slot"])) and w["state"] == "ready" for w in s["workers"])

    reply, s = _ask_and_wait(state_dir, {"op": "restart", "now": now}, timeout, replaced, "every worker replaced")
    if reply.get("checkpoint_changed"):
        click.echo(f"preload: the checkpoint changed on disk since the daemon loaded it ({', '.join(reply['checkpoint_changed'])});"
                   " the workers restart on the weights it holds; `preload stop` and `preload start` load the"
                   " files as they are now", err=True)
    pids = ", ".join(str(w["pid"]) for w in s["workers"])
    click.echo(f"{len(s['workers'])} workers replaced in {time.monotonic() - t0:.2f} s (pids {pids})")


@click.command()
@state_dir_option
@click.option("--level", type=click.IntRange(1, 2), default=1, show_default=True,
              help="1: the weights stay (in host memory); 2: the weights go too, read again at wake.")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds to wait for the sleep.")
def sleep(state_dir, level, timeout):
    """Free the device: every engine core stops (the fronts hold the clients; /health says sleeping)."""
    t0 = time.monotonic()
    _, s = _ask_and_wait(state_dir, {"op": "sleep", "level": level}, timeout,
                         lambda _, s: (s.get("sleep") or {}).get("asleep"), "asleep")
    if s["sleep"].get("error"):  # (asleep, but the weights could not go where level 1 keeps them)
        click.echo(f"preload: asleep (level {level}), but {s['sleep']['error']}", err=True)
        sys.exit(1)
    held, kept = s["sleep"]["host_bytes"] / 2**30, s["sleep"].get("spares_kept", 0)
    click.echo(f"asleep (level {level}) in {time.monotonic() - t0:.2f} s; {held:.2f} GiB of weights held in host memory"
               + (f"; {kept} spare(s) kept on the device, their weights let go" if kept else ""))


@click.command()
@state_dir_option
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for every worker.")
def wake(state_dir, timeout):
    """Serve again after `preload sleep`: the weights back (level 2: read again), a core in every slot."""
    t0 = time.monotonic()

    def failed_wakes(s: dict) -> int:
        return (s.get("sleep") or {}).get("failed_wakes", 0)

    _, s = _ask_and_wait(state_dir, {"op": "wake"}, timeout,
                         lambda before, s: s["state"] == "ready" or failed_wakes(s) > failed_wakes(before), "ready")
    if s["state"] != "ready":
        click.echo(f"preload: still asleep: {s['sleep']['error']} (`preload wake` tries again)", err=True)
        sys.exit(1)
    click.echo(f"awake in {time.monotonic() - t0:.2f} s")


def _ask_and_wait(state_dir, request: dict, timeout: float, done, what: str) -> tuple[dict, dict]:
    """Send `request`, then poll the status until `done(status before, status now)`: the
    reply and the last status; exit 1 with the daemon's error, or after `timeout`."""
    from preload.ipc.client import DaemonClient, DaemonError, DaemonUnavailable

    state_dir = state_dir_path(state_dir)
    deadline = time.monotonic() + timeout
    try:
        with DaemonClient(state_dir, timeout=5) as client:
            before = client.request("status")["status"]
            reply = client.request(**request)
            while not done(before, s := client.request("status")["status"]):
                if time.monotonic() > deadline:
                    click.echo(f"preload: not {what} within {timeout:.0f} s (state: {s['state']})", err=True)
                    sys.exit(1)
                time.sleep(0.02)
    except (DaemonUnavailable, DaemonError) as e:
        click.echo(f"preload: {e}", err=True)
        sys.exit(1)
    return reply, s


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

