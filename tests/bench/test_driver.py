"""The daemon driver the benchmarks and tests share, and one end-to-end run of
`preload bench restart` on the bundled model (one restart of each kind)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import threading

import psutil
import pytest

from preload.bench import driver
from preload.bench.restart import KINDS


@pytest.fixture
def http_port():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            code = 200 if self.path == "/ok" else 503
            self.send_response(code)
            self.end_headers()
            self.wfile.write(self.path.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_http_get_and_ports(http_port):
    assert driver.http_get(http_port, "/ok") == (200, b"/ok")
    assert driver.http_get(http_port, "/other")[0] == 503
    assert not driver.port_is_free(http_port)
    port = driver.free_port()
    assert driver.port_is_free(port)
    with pytest.raises(OSError):
        driver.http_get(port, "/ok", timeout=1)


def test_wait_for_returns_the_last_value():
    values = iter([0, None, 3])
    assert driver.wait_for(lambda: next(values), timeout=5, interval=0) == 3
    assert driver.wait_for(lambda: [], timeout=0.05, interval=0.01) == []


def test_a_failed_start_raises_and_leaves_nothing_running(tmp_path):
    state_dir = tmp_path / "state"
    with pytest.raises(driver.DaemonError, match="preload start failed"):
        driver.start_daemon(state_dir, tmp_path / "no-such-model", "--device", "cpu")
    assert driver.daemon_processes(state_dir) == []


def test_bench_restart_end_to_end(tmp_path):
    """Every kind once on the bundled model: the figures are there and mean what they say."""
    out = tmp_path / "restart.json"
    r = driver.preload("bench", "restart", "--device", "cpu", "--restarts", 1, "--cold-repeat", 1, "--no-large",
                       "--json", out, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    [model] = json.loads(out.read_text())["models"]
    for kind in KINDS:
        [run] = model["restart"][kind]["runs"]
        assert run["new_pid"] != run["old_pid"] and 0 < run["seconds"] < run["old_gone_and_status_ready_s"]
        b = run["breakdown"]
        assert b["old_reaped_s"] is not None and b["go_to_ready_s"] is not None and b["ready_to_answer_s"] is not None
    assert model["restart"]["sigkill-spare"]["promoted"] == 1 and model["restart"]["sigkill"]["runs"][0]["via"] == "fork"
    assert model["cold"]["runs"][0]["breakdown"]["load_s"] > 0
    assert "error" not in model["worker_stages"]
    assert "sigkill-no-zygote" in r.stdout
    assert not [p for p in tmp_path.iterdir() if p.name != "restart.json"]


def test_a_bench_stopped_by_sigterm_stops_the_daemons_it_started(tmp_path):
    """`timeout N preload bench ...` past its time sends SIGTERM: the bench exits 143, and
    no daemon, zygote or worker it started runs on (a daemon is detached, in its own
    session: left running, it would hold the GPU for whatever runs next)."""

    def started() -> list[psutil.Process]:  # (their state dirs are under the bench's TMPDIR)
        return [p for p in psutil.process_iter(["cmdline", "status"]) if p.pid != bench.pid
                and str(tmp_path) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]

    bench = subprocess.Popen([*driver.COMMAND, "bench", "cold", "--device", "cpu", "--quant", "none", "--repeat", "5",
                              "--workers", "1", "--json", str(tmp_path / "cold.json")],
                             env=os.environ | {"TMPDIR": str(tmp_path)}, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=(tmp_path / "bench.err").open("w"))
    try:
        daemons = driver.wait_for(lambda: [p for p in started() if "preload daemon" in " ".join(p.info["cmdline"])],
                                  180, 0.1)
        assert daemons and bench.poll() is None, (tmp_path / "bench.err").read_text()[-2000:]
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(120) == 128 + signal.SIGTERM
        assert driver.wait_for(lambda: not started(), 30) is True, [p.info["cmdline"] for p in started()]
    finally:
        if bench.poll() is None:
            bench.kill()
        bench.wait()
        for p in started():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
