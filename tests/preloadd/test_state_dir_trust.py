"""The state dir trusts no one (issue 13): a state dir another user made, one reached
through a symlink, or one below a directory others may write is refused before anything
is written there; `preload stop` signals only a daemon of ours for that state dir, never
a pid a planted lock file names; an allow-listed uid may attach but not restart or shut
the daemon down."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest
from daemons import preload, running_daemon
from other_uids import NOBODY, as_nobody, open_to_others

from preload.ipc.client import DaemonClient, DaemonError


def start(state_dir, model):
    return preload("start", "--model", str(model), "--state-dir", str(state_dir), "--health-port", "0")


def test_a_symlinked_state_dir_is_refused_and_its_target_left_alone(tiny_checkpoint, tmp_path):
    target = tmp_path / "victim"
    target.mkdir(mode=0o755)
    (tmp_path / "state").symlink_to(target)
    r = start(tmp_path / "state", tiny_checkpoint)
    assert r.returncode != 0 and "not a directory of ours" in r.stderr, r.stderr
    assert os.stat(target).st_mode & 0o777 == 0o755 and not any(target.iterdir())


def test_a_state_dir_of_another_user_is_refused(tiny_checkpoint, tmp_path):
    theirs = tmp_path / "state"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, NOBODY, NOBODY)
    r = start(theirs, tiny_checkpoint)
    assert r.returncode != 0 and f"belongs to uid {NOBODY}" in r.stderr, r.stderr
    assert not any(theirs.iterdir())


def test_a_state_dir_below_a_directory_others_may_write_is_refused(tiny_checkpoint, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # no sticky bit: anyone could rename our state dir away and put theirs there
    r = start(shared / "state", tiny_checkpoint)
    assert r.returncode != 0 and "writable by others" in r.stderr, r.stderr


def test_stop_never_signals_a_pid_that_a_lock_file_names(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # A lock of ours, held, naming a process that is not our daemon.
        with open(state / "daemon.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            lock.write(f"{bystander.pid}\n")
            lock.flush()
            r = preload("stop", "--state-dir", str(state))
            assert r.returncode != 0 and "not our daemon" in r.stderr, r.stderr
        # A lock another user planted: not read at all.
        os.chown(state / "daemon.lock", NOBODY, NOBODY)
        with open(state / "daemon.lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            r = preload("stop", "--state-dir", str(state))
            assert "no preload daemon running" in r.stdout, r.stdout + r.stderr
        assert bystander.poll() is None, "the bystander was signalled"
    finally:
        bystander.kill()
        bystander.wait()


def ask(state_dir: str, op: str) -> dict:
    """Runs as uid 65534."""
    try:
        with DaemonClient(state_dir, timeout=5) as client:
            return {"reply": client.request(op)}
    except DaemonError as e:
        return {"refused": str(e)}


@pytest.mark.parametrize("op", ["shutdown", "restart"])
def test_an_allow_listed_uid_may_attach_but_not_run_the_daemon(tiny_checkpoint, base_dir, op):
    with running_daemon(base_dir / f"state-{op}", tiny_checkpoint, "--allow-uid", NOBODY) as d:
        open_to_others(d.state_dir)
        assert "reply" in as_nobody(ask, str(d.state_dir), "status")  # allowed: it may attach
        got = as_nobody(ask, str(d.state_dir), op)
        assert "own uid" in got.get("refused", ""), got
        assert d.get("/health").status_code == 200 and d.status()["pid"] == d.pid
