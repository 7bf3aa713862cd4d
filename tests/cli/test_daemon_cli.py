"""The daemon's lifecycle through the real command line: `preload start` returns once
the weights are resident, probes and `preload status` tell the truth, a second daemon
is refused, and SIGTERM or `preload stop` leave no process, socket, fd or memory."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemons import (
    arena_holders,
    arena_inodes,
    daemon_processes,
    free_port,
    port_is_free,
    preload,
    running_daemon,
    sockets_in,
    stop_everything,
    wait_for,
)
from safetensors import safe_open
from supervised import dead

from preload import BUNDLED_MODEL


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{text}"
    return lines[0]


@pytest.fixture(scope="module")
def daemon(tiny_checkpoint, tmp_path_factory):
    """One daemon shared by the tests that only look at it. Its state dir exists
    beforehand with mode 0755, as an operator might have made it."""
    state_dir = tmp_path_factory.mktemp("lifecycle") / "state"
    state_dir.mkdir()
    os.chmod(state_dir, 0o755)
    with running_daemon(state_dir, tiny_checkpoint) as d:
        yield d


def test_start_returns_zero_once_ready(daemon):
    assert daemon.start.returncode == 0
    assert f"pid {daemon.pid}" in daemon.start.stdout
    # Ready means ready: the very first probe after `preload start` returns succeeds.
    health = daemon.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ready"
    # The daemon, and the keeper that holds the weights should it crash.
    assert sorted(p.pid for p in daemon_processes(daemon.state_dir)) == sorted([daemon.pid, daemon.status()["keeper_pid"]])


def test_status_reports_what_is_resident(daemon, tiny_checkpoint):
    s = daemon.status()
    assert s["state"] == "ready"
    assert s["pid"] == daemon.pid
    assert Path(s["model"]).resolve() == tiny_checkpoint.resolve()
    assert s["quant"] == "none"
    assert s["transport"] == "memfd"
    assert re.fullmatch(r"[0-9a-f]{64}", s["fingerprint"])
    assert s["attached_workers"] == []
    assert isinstance(s["uptime_s"], int | float) and s["uptime_s"] >= 0
    # Every weight is resident: the arena holds at least the checkpoint's tensor bytes.
    with safe_open(tiny_checkpoint / "model.safetensors", "pt") as f:
        weight_bytes = sum(_nbytes(f, name) for name in f.keys())
    assert set(s["bytes_per_device"]) == {"cpu"}
    assert s["bytes_per_device"]["cpu"] >= weight_bytes


def _nbytes(f, name: str) -> int:
    t = f.get_tensor(name)
    return t.numel() * t.element_size()


def test_metrics_are_prometheus_text(daemon):
    response = daemon.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    m = daemon.metrics()
    assert m["preload_load_seconds"] > 0
    assert m['preload_resident_bytes{device="cpu"}'] == daemon.status()["bytes_per_device"]["cpu"]
    assert "preload_attaches_total" in m
    assert "preload_errors_total" in m


def test_status_command(daemon, tiny_checkpoint):
    fingerprint = daemon.status()["fingerprint"]
    r = preload("status", "--state-dir", daemon.state_dir)
    assert r.returncode == 0, r.stderr
    assert "ready" in r.stdout
    assert str(tiny_checkpoint) in r.stdout
    assert fingerprint in r.stdout
    assert f"pid {daemon.pid}" in r.stdout


def test_status_json_command_matches_the_http_status(daemon):
    r = preload("status", "--state-dir", daemon.state_dir, "--json")
    assert r.returncode == 0, r.stderr
    cli, http = json.loads(r.stdout), daemon.status()
    for key in ("model", "quant", "transport", "bytes_per_device", "fingerprint", "attached_workers", "pid", "state"):
        assert cli[key] == http[key], key
    assert cli["uptime_s"] <= http["uptime_s"]


def test_state_dir_is_private_and_sockets_are_owner_only(daemon):
    assert stat.S_IMODE(daemon.state_dir.stat().st_mode) == 0o700
    assert sockets_in(daemon.state_dir) == ["control.sock", "fds.sock", "keeper.sock"]
    for name in ("control.sock", "fds.sock", "keeper.sock"):
        st = (daemon.state_dir / name).stat()
        assert stat.S_ISSOCK(st.st_mode), name
        assert stat.S_IMODE(st.st_mode) == 0o600, name
        assert st.st_uid == os.getuid()


def test_daemon_writes_a_log_in_its_state_dir(daemon):
    log = daemon.state_dir / "daemon.log"
    assert "ready" in log.read_text()


def test_second_daemon_on_the_same_state_dir_is_refused_naming_the_running_pid(daemon, tiny_checkpoint):
    before = daemon.status()["fingerprint"]
    port = free_port()
    r = preload("start", "--model", tiny_checkpoint, "--state-dir", daemon.state_dir, "--health-port", port)
    assert r.returncode != 0
    line = one_line(r.stderr)
    assert f"pid {daemon.pid}" in line
    assert str(daemon.state_dir) in line
    # The running daemon is untouched: still serving, same weights, same sockets, alone.
    assert daemon.get("/health").status_code == 200
    assert daemon.status()["fingerprint"] == before
    assert sockets_in(daemon.state_dir) == ["control.sock", "fds.sock", "keeper.sock"]
    assert sorted(p.pid for p in daemon_processes(daemon.state_dir)) == sorted([daemon.pid, daemon.status()["keeper_pid"]])
    assert port_is_free(port)


def test_status_and_stop_without_a_daemon(tmp_path):
    r = preload("status", "--state-dir", tmp_path)
    assert r.returncode == 1
    assert "no preload daemon" in one_line(r.stderr)
    r = preload("stop", "--state-dir", tmp_path)
    assert r.returncode == 0
    assert "no preload daemon" in r.stdout


def test_sigterm_stops_cleanly_and_removes_sockets(tiny_checkpoint, tmp_path):
    state_dir = tmp_path / "state"
    with running_daemon(state_dir, tiny_checkpoint) as d:
        assert sockets_in(state_dir) == ["control.sock", "fds.sock", "keeper.sock"]
        os.kill(d.pid, signal.SIGTERM)
        assert wait_for(lambda: dead(d.pid), timeout=15), "daemon did not exit on SIGTERM"
        assert sockets_in(state_dir) == []
        assert daemon_processes(state_dir) == []
        assert port_is_free(d.port)
        assert "SIGTERM" in (state_dir / "daemon.log").read_text()


def test_stop_never_reports_a_hung_daemon_as_absent(tiny_checkpoint, tmp_path):
    """A daemon that does not answer (here: SIGSTOPped) is still running and still
    holds the state dir: `preload stop` must end it anyway (SIGKILL after --timeout: a
    stop always stops, issue 36), saying so; saying that no daemon runs would leave the
    operator with a ghost."""
    state_dir = tmp_path / "state"
    with running_daemon(state_dir, tiny_checkpoint) as d:
        os.kill(d.pid, signal.SIGSTOP)
        try:
            r = preload("stop", "--state-dir", state_dir, "--timeout", 5, timeout=60)
        finally:
            if not dead(d.pid):
                os.kill(d.pid, signal.SIGCONT)
        assert "no preload daemon running" not in r.stdout + r.stderr
        assert r.returncode == 0 and dead(d.pid), r.stdout + r.stderr
        assert f"daemon pid {d.pid} did not exit within 5 s; killed" in r.stderr



def test_status_of_a_stalled_daemon_says_so_and_reads_no_foreign_document(tiny_checkpoint, tmp_path):
    """Issue 36: a SIGSTOPped daemon answers neither its control socket nor its health
    port; `preload status` says so with the time it really waited (it once said "5000 ms"
    after 10.5 s). What answers on the health port meanwhile (here: another program's
    /status, as if the port had been taken) is not read as the daemon's (it once failed
    with a raw KeyError 'uptime_s')."""
    import http.server
    import threading

    class Foreign(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok", "service": "something else"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state_dir = tmp_path / "state"
    try:
        with running_daemon(state_dir, tiny_checkpoint) as d:
            info = json.loads((state_dir / "daemon.json").read_text())
            (state_dir / "daemon.json").write_text(json.dumps(info | {"health_port": server.server_address[1]}))
            os.kill(d.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                r = preload("status", "--state-dir", state_dir, timeout=60)
                waited = time.monotonic() - t0
            finally:
                os.kill(d.pid, signal.SIGCONT)
            line = one_line(r.stderr)
            assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
            said = re.search(rf"the daemon \(pid {d.pid}\) holds .* but answered neither its control socket nor its"
                             r" health port in ([0-9.]+) s: stopped \(SIGSTOP\) or stalled", line)
            assert said, line
            assert 5.0 <= float(said.group(1)) <= waited, (said.group(1), waited)
    finally:
        server.shutdown()


def test_a_link_planted_as_the_daemons_log_is_refused_not_written_through(tiny_checkpoint, tmp_path):
    """Issue 36: a symbolic link where daemon.log goes is refused with one line that
    names it (not a traceback), in the background and in the foreground, and what it
    points to is untouched."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    target = tmp_path / "outside.log"
    target.write_text("keep\n")
    (state_dir / "daemon.log").symlink_to(target)
    for foreground in ((), ("--foreground",)):
        r = preload("start", "--model", tiny_checkpoint, "--device", "cpu", "--workers", 0, "--state-dir", state_dir,
                    "--port", free_port(), *foreground, timeout=60)
        assert r.returncode == 1, r.stdout + r.stderr
        line = one_line(r.stderr)
        assert f"{state_dir / 'daemon.log'} is a symbolic link, which preload never writes through" in line, line
    assert target.read_text() == "keep\n"
    assert not daemon_processes(state_dir)

# A worker attached to the daemon: it hashes its weights, then on each line from the
# test checks them again, and at the end lets go of them.
ATTACHED_WORKER = r"""
import hashlib, sys
import torch
from preload import attach

def digest(weights):
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

weights = attach(sys.argv[1])
before = digest(weights)
print("attached", flush=True)
sys.stdin.readline()
print("intact" if digest(weights) == before else "changed", flush=True)
sys.stdin.readline()
try:
    weights.close()
    print("closed", flush=True)
except Exception as e:
    print(f"close failed: {type(e).__name__}: {e}", flush=True)
"""


def test_stop_leaves_no_process_socket_fd_or_memory(tiny_checkpoint, tmp_path):
    """`preload stop` ends the daemon at once; the weights live on in a worker still
    attached, and are gone (no fd, no mapping, anywhere) once that worker lets go."""
    state_dir = tmp_path / "state"
    with running_daemon(state_dir, tiny_checkpoint) as d:
        inodes = arena_inodes(d.pid)
        assert len(inodes) == 1, "the daemon should hold exactly one arena memfd"
        worker = subprocess.Popen(
            [sys.executable, "-c", ATTACHED_WORKER, str(state_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert worker.stdout.readline().strip() == "attached"
            assert worker.pid in d.status()["attached_workers"]

            r = preload("stop", "--state-dir", state_dir)
            assert r.returncode == 0, r.stderr
            assert f"pid {d.pid}" in r.stdout
            assert dead(d.pid)
            assert daemon_processes(state_dir) == []
            assert sockets_in(state_dir) == []
            assert port_is_free(d.port)
            assert set(arena_holders(inodes)) == {worker.pid}, "only the attached worker may still hold the weights"

            worker.stdin.write("\n")
            worker.stdin.flush()
            assert worker.stdout.readline().strip() == "intact", "an attached worker's weights changed when the daemon stopped"
            worker.stdin.write("\n")
            worker.stdin.flush()
            closed = worker.stdout.readline().strip()
            assert worker.wait(timeout=60) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        assert arena_holders(inodes) == {}, "an arena fd or mapping outlived the daemon and its last worker"
        # Letting go of weights whose daemon is gone is not an error for the worker.
        assert closed == "closed"


def test_health_port_in_use_is_a_clear_error_and_leaves_nothing(tiny_checkpoint, tmp_path):
    state_dir = tmp_path / "state"
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            r = preload("start", "--model", tiny_checkpoint, "--state-dir", state_dir, "--health-port", port)
        assert r.returncode != 0
        line = one_line(r.stderr)
        assert str(port) in line
        assert "in use" in line.lower()
        assert sockets_in(state_dir) == []
        assert daemon_processes(state_dir) == []
    finally:
        stop_everything(state_dir)


def test_start_without_model_serves_the_bundled_model(tmp_path):
    if not Path(BUNDLED_MODEL, "model.safetensors").exists():
        pytest.skip("the bundled model (bundled/tiny-v3/model.safetensors) has not been trained yet")
    with running_daemon(tmp_path / "state", None) as d:
        s = d.status()
        assert Path(s["model"]).resolve() == Path(BUNDLED_MODEL).resolve()
        assert d.get("/health").status_code == 200


def test_version_is_the_installed_package_version():
    from importlib.metadata import version

    r = subprocess.run([sys.executable, "-m", "preload.cli.main", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"preload, version {version('preload')}"


def test_port_zero_reports_the_real_ports_and_status_answers_while_loading(tiny_checkpoint, tmp_path):
    """--port 0: the start line, status and daemon.json give the ports the kernel chose;
    `preload status` during the load (no control socket yet) reads /status over HTTP."""
    with running_daemon(tmp_path / "state", tiny_checkpoint, "--workers", "1", "--port", "0", "--dtype", "float32") as d:
        line = d.start.stdout
        api_port = int(re.search(r"serving http://127\.0\.0\.1:(\d+)/v1 \(1 worker\)", line).group(1))
        assert api_port > 0 and f"health port {d.port}" in line and re.search(r"ready \(pid \d+\) in [\d.]+ s", line)
        status = json.loads(preload("status", "--state-dir", str(d.state_dir), "--json").stdout)
        assert status["port"] == api_port and status["health_port"] == d.port
        info = json.loads((d.state_dir / "daemon.json").read_text())
        assert info["api_port"] == api_port and info["pid"] == d.pid
        assert stat.S_IMODE((d.state_dir / "daemon.json").stat().st_mode) == 0o600
        assert f"API port 127.0.0.1:{api_port}" in (d.state_dir / "daemon.log").read_text()
        # The control socket gone (as before it is made): status falls back to the health port.
        (d.state_dir / "control.sock").rename(d.state_dir / "control.sock.away")
        try:
            r = preload("status", "--state-dir", str(d.state_dir))
            assert r.returncode == 0 and "ready" in r.stdout, r.stderr
        finally:
            (d.state_dir / "control.sock.away").rename(d.state_dir / "control.sock")
    assert not (d.state_dir / "daemon.json").exists()


def test_status_and_stop_of_a_dead_daemon_find_what_it_left(tiny_checkpoint, tmp_path):
    """The daemon SIGKILLed, its worker serves on: `preload status` says so at once (no
    wait for a socket nobody answers), and `preload stop` stops the leftovers."""
    from supervised import start_args

    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port)) as d:
        [w], keeper = d.status()["workers"], d.status()["keeper_pid"]
        os.kill(d.pid, signal.SIGKILL)
        assert wait_for(lambda: dead(d.pid), timeout=10)
        t0 = time.monotonic()
        r = preload("status", "--state-dir", str(d.state_dir))
        assert time.monotonic() - t0 < 4 and r.returncode == 1
        assert "no preload daemon runs" in r.stderr and f"pid {w['pid']}: preload worker 0" in r.stderr, r.stderr
        assert f"pid {keeper}: preload keeper" in r.stderr, r.stderr  # holding the weights for a new daemon
        r = preload("stop", "--state-dir", str(d.state_dir))
        assert str(w["pid"]) in r.stdout and "stopped what it left running" in r.stdout, r.stdout
        for pid in (w["pid"], keeper):
            assert dead(pid)
