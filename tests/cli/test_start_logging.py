"""daemon.log (issue 13, item 8): it rotates, so that a daemon running for months keeps
a bounded log, and a start that fails says why in it at ERROR level, not only on the
stderr of a `preload start` that may be long gone. The logs that processes write through
their stdout and stderr (worker-N.log, spares.log, keeper.log) rotate as a process
opens them."""

from __future__ import annotations

import logging
import os
import re
import socket
from logging.handlers import RotatingFileHandler

import pytest
from daemons import daemon_processes, preload, sockets_in, stop_everything

from preload.cli import start
from preload.ipc import protocol

# asctime, the logger's name, the level: as _log_to formats every record
ERROR_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} preload\.daemon ERROR (?P<message>.*)$", re.MULTILINE)


@pytest.fixture
def root_logging():
    """_log_to configures the root logger (force=True): put back what pytest had."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers:
        if h not in handlers:
            h.close()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_the_shipped_log_limits_keep_it_bounded():
    assert 0 < start.LOG_BYTES <= 64 << 20 and 1 <= start.LOG_BACKUPS <= 10
    assert start.LOG_BYTES * (start.LOG_BACKUPS + 1) <= 256 << 20


def test_daemon_log_rotates_and_stays_bounded(tmp_path, monkeypatch, root_logging):
    limit = 4096
    monkeypatch.setattr(start, "LOG_BYTES", limit)
    path = tmp_path / "daemon.log"
    start._log_to(path, to_stderr=False)
    rotating = [h for h in logging.getLogger().handlers if isinstance(h, RotatingFileHandler)]
    assert len(rotating) == 1 and rotating[0].baseFilename == str(path)
    assert rotating[0].maxBytes == limit and rotating[0].backupCount == start.LOG_BACKUPS

    log = logging.getLogger("preload.daemon")
    lines = 600  # of about 100 bytes: 3 to 4 times what the log and its backups hold together
    for i in range(lines):
        log.info("line %06d %s", i, "x" * 40)
    for h in rotating:
        h.flush()

    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["daemon.log"] + [f"daemon.log.{n}" for n in range(1, start.LOG_BACKUPS + 1)], files
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert all(size <= limit for size in sizes.values()), sizes
    assert sum(sizes.values()) <= (start.LOG_BACKUPS + 1) * limit
    # The newest lines are in daemon.log, the oldest were let go.
    assert f"line {lines - 1:06d}" in path.read_text()
    assert not any("line 000000" in p.read_text() for p in tmp_path.iterdir())


def failed_start(state_dir, *args):
    """`preload start` that must fail; its stderr and the ERROR lines of its daemon.log."""
    try:
        r = preload("start", "--state-dir", state_dir, *(() if "--workers" in args else ("--workers", 0)), *args)
        assert r.returncode != 0, r.stdout + r.stderr
        assert sockets_in(state_dir) == [] and daemon_processes(state_dir) == []
    finally:
        stop_everything(state_dir)
    log = (state_dir / "daemon.log").read_text()
    return r.stderr, [m["message"] for m in ERROR_LINE.finditer(log)], log


def test_a_failed_start_logs_its_cause_as_an_error(tmp_path):
    """The checkpoint is not one: the daemon gives up before loading anything."""
    model = tmp_path / "no-such-checkpoint"
    stderr, errors, log = failed_start(tmp_path / "state", "--model", model, "--health-port", "0")
    assert any(f"{model}/config.json: not found" in e for e in errors), log
    assert f"{model}/config.json: not found" in stderr


def test_a_start_that_fails_while_binding_logs_its_cause_as_an_error(tiny_checkpoint, tmp_path):
    """The health port is taken: the daemon fails inside its run, after its checks passed."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        stderr, errors, log = failed_start(tmp_path / "state", "--model", tiny_checkpoint, "--health-port", port)
    assert any(str(port) in e and "in use" in e.lower() for e in errors), log


def test_a_daemon_whose_imports_fail_logs_the_cause_as_an_error(tiny_checkpoint, tmp_path, monkeypatch):
    """A broken install (here a torch that cannot be imported, which `preload start` itself
    never imports, and the daemon only for a load that quantizes) is a failed start like any
    other: an ERROR line, and its cause on stderr."""
    broken = tmp_path / "broken-site" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("this torch is broken on purpose")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(broken.parent), os.environ.get("PYTHONPATH")])))
    stderr, errors, log = failed_start(tmp_path / "state", "--model", tiny_checkpoint, "--quant", "fp8_block",
                                       "--health-port", "0")
    assert any("this torch is broken on purpose" in e for e in errors), log
    assert "this torch is broken on purpose" in stderr


def test_a_log_a_process_writes_through_its_stderr_rotates_as_one_opens_it(tmp_path, monkeypatch):
    """A worker's log is its stdout and stderr, which cannot rotate under it: each worker
    (or keeper) that opens it rotates it first once past the limit, keeping LOG_BACKUPS."""
    monkeypatch.setattr(protocol, "LOG_BYTES", 100)
    log = tmp_path / "worker-0.log"
    for start_no in range(6):  # six starts of the slot's worker, each writing 150 bytes
        fd = protocol.open_log(log)
        assert os.fstat(fd).st_mode & 0o777 == 0o600
        os.write(fd, f"{start_no}".encode() * 150)
        os.close(fd)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["worker-0.log"] + [f"worker-0.log.{i}" for i in range(1, protocol.LOG_BACKUPS + 1)], names
    assert log.read_text() == "5" * 150  # the newest start's own, alone
    assert (tmp_path / "worker-0.log.1").read_text() == "4" * 150
    assert (tmp_path / f"worker-0.log.{protocol.LOG_BACKUPS}").read_text() == str(5 - protocol.LOG_BACKUPS) * 150
    monkeypatch.setattr(protocol, "LOG_BYTES", 1000)
    fd = protocol.open_log(log)  # under the limit: appended to, not rotated
    os.write(fd, b"!")
    os.close(fd)
    assert log.read_text() == "5" * 150 + "!" and len(list(tmp_path.iterdir())) == protocol.LOG_BACKUPS + 1
