"""The systemd unit runs as written: Type=notify, and the daemon speaks the protocol
(READY=1 once weights are resident and workers answer, STATUS while loading, STOPPING=1).
The unit file is checked by systemd-analyze where systemd is installed."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from daemons import PRELOAD, free_port, preload

from preload.options import WorkerOptions

UNIT = Path(__file__).parents[2] / "deploy" / "preload.service"
INSTALLED = "/opt/preload/bin/preload"


def service_section() -> dict[str, str]:
    """The unit's [Service] settings (each key once in this unit), comments dropped."""
    settings, section = {}, None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            assert key not in settings, f"{key}= twice: this parser takes each key once"
            settings[key] = value
    return settings


def seconds(value: str) -> float:
    assert value.isdigit(), f"{value}: give systemd's times in plain seconds here"
    return float(value)


def run_exec_stop(tmp_path: Path, **env: str) -> list[str] | None:
    """Run the unit's ExecStop= as systemd would, with the environment systemd gives it
    (`env`: MAINPID, SERVICE_RESULT, ...), the installed `preload` replaced by a stub that
    records its arguments: the arguments `preload` was run with, or None if it was not."""
    argv = shlex.split(service_section()["ExecStop"].replace("$$", "$"))  # systemd's $$ -> $
    calls = tmp_path / "calls"
    stub = tmp_path / "preload"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    stub.chmod(0o755)
    argv = [a.replace(INSTALLED, str(stub)) for a in argv]
    r = subprocess.run(argv, env={"PATH": "/usr/bin:/bin"} | env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"ExecStop failed ({r.returncode}): {r.stderr}"  # systemd would log a failed stop
    return calls.read_text().split() if calls.exists() else None


def test_a_deliberate_stop_stops_the_daemon_keeper_and_workers(tmp_path):
    """`systemctl stop preload` while the daemon runs (systemd passes its $MAINPID): ExecStop
    runs `preload stop`, which drains the workers and ends the keeper; its timeout covers the
    daemon's own stop (drain, then up to 20 s to reap the workers) and fits in
    TimeoutStopSec, so systemd never cuts a drain short."""
    args = run_exec_stop(tmp_path, MAINPID="4242", SERVICE_RESULT="success")
    assert args is not None and args[0] == "stop", args
    timeout = float(args[args.index("--timeout") + 1])
    assert WorkerOptions().drain_timeout + 20 <= timeout < seconds(service_section()["TimeoutStopSec"])


@pytest.mark.parametrize("result", ["signal", "core-dump", "exit-code", "success"])
def test_after_the_daemon_died_the_unit_leaves_keeper_and_workers_running(tmp_path, result):
    """systemd also runs ExecStop= after the main process died on its own (SIGKILL, a
    crash, an exit), with $MAINPID unset. Then the keeper keeps the weights and the API
    socket and the workers keep serving, for the daemon that Restart=on-failure starts to
    take back without a load: nothing is stopped."""
    assert run_exec_stop(tmp_path, SERVICE_RESULT=result, EXIT_CODE="killed", EXIT_STATUS="KILL") is None


def test_only_the_daemon_is_signalled_and_a_crash_restarts_it():
    """KillMode=process: systemd's SIGTERM/SIGKILL reach the daemon alone (a SIGTERM drains
    as `preload stop` does); the keeper and the workers outlive a crashed daemon."""
    s = service_section()
    assert (s["KillMode"], s["Restart"], s["RuntimeDirectoryPreserve"]) == ("process", "on-failure", "restart")
    assert re.search(r"\bstop\b", s["ExecStop"]) and "MAINPID" in s["ExecStop"]


def test_the_daemon_tells_systemd_when_it_is_ready_and_when_it_stops(tiny_checkpoint, tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify.sock"))
    listener.settimeout(120)
    state = tmp_path / "state"
    env = os.environ | {"NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
    cmd = [sys.executable, "-m", "preload.cli.main", "start", "--foreground", "--model", str(tiny_checkpoint),
           "--state-dir", str(state), "--workers", "1", "--port", str(free_port()), "--health-port", "0",
           "--dtype", "float32"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(listener.recv(4096).decode())
        ready = next(m for m in messages if "READY=1" in m)
        assert f"MAINPID={proc.pid}" in ready and "STATUS=ready: 1 worker on" in ready, ready
        assert preload("status", "--state-dir", str(state)).returncode == 0  # ready means ready
        preload("stop", "--state-dir", str(state))
        assert "STOPPING=1" in listener.recv(4096).decode()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_unit_file_verifies(tmp_path):
    """As installed: the preload command where the unit expects it (here: this venv's)."""
    unit = UNIT.read_text().replace("/opt/preload/bin/preload", PRELOAD)
    assert "Type=notify" in unit
    (tmp_path / "preload.service").write_text(unit)
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "preload.service")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
