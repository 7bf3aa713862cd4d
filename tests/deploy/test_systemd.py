"""The systemd unit runs as written: Type=notify, and the daemon speaks the protocol
(READY=1 once weights are resident and workers answer, STATUS while loading, STOPPING=1).
The unit file is checked by systemd-analyze where systemd is installed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from daemons import PRELOAD, free_port, preload

UNIT = Path(__file__).parents[2] / "deploy" / "preload.service"


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
        assert f"MAINPID={proc.pid}" in ready and "STATUS=ready: 1 workers" in ready, ready
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
