"""The state dir trusts no one (issues 13, 36): a state dir another user made, one reached
through a symlink, one others could write (whatever they planted in it stays), or one below
a directory others may write is refused before anything is written there; `preload stop` signals only a daemon of ours for that state dir, never
a pid a planted lock file names; an allow-listed uid may attach but not restart or shut
the daemon down."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemons import preload, running_daemon
from other_uids import NOBODY, as_nobody, open_to_others

from preload.ipc.client import DaemonClient, DaemonError
from preload.preloadd.state_dir import StateDirError, prepare_state_dir


def start(state_dir, model):
    """`preload start`, meant to be refused: a daemon it started anyway (the test then fails
    on the exit status) is stopped, not left running."""
    r = preload("start", "--model", str(model), "--state-dir", str(state_dir), "--health-port", "0", "--workers", "0")
    if r.returncode == 0:
        preload("stop", "--state-dir", str(state_dir))
    return r


def test_a_symlinked_state_dir_is_refused_and_its_target_left_alone(tiny_checkpoint, tmp_path):
    target = tmp_path / "victim"
    target.mkdir(mode=0o755)
    (tmp_path / "state").symlink_to(target)
    r = start(tmp_path / "state", tiny_checkpoint)
    assert r.returncode != 0 and "not a directory of ours" in r.stderr, r.stderr
    assert os.stat(target).st_mode & 0o777 == 0o755 and not any(target.iterdir())


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777])
def test_a_state_dir_others_could_write_is_refused_and_nothing_it_links_to_is_touched(tiny_checkpoint, tmp_path, mode):
    """Issue 36's reproduction: links a group member planted before (the metrics dir, a
    worker's log) would have been followed, their targets' files deleted or written; the
    dir is refused instead, as ssh refuses a ~/.ssh others can write, with nothing done."""
    state, victim, outside = tmp_path / "d" / "p", tmp_path / "v", tmp_path / "outside.log"
    state.mkdir(parents=True, mode=0o700)
    os.chmod(state, mode)
    victim.mkdir()
    (victim / "important.txt").write_text("k\n")
    outside.write_text("mine\n")
    for name, target in (("metrics", victim), ("worker-0.log", outside), ("keeper.log", outside)):
        (state / name).symlink_to(target)
    r = preload("start", "--model", str(tiny_checkpoint), "--state-dir", str(state), "--health-port", "0",
                "--workers", "1", "--port", "0", "--device", "cpu")
    if r.returncode == 0:
        preload("stop", "--state-dir", str(state))
    assert r.returncode != 0 and "writable by" in r.stderr and str(state) in r.stderr, r.stderr
    assert (victim / "important.txt").read_text() == "k\n" and outside.read_text() == "mine\n"
    assert sorted(p.name for p in state.iterdir()) == ["keeper.log", "metrics", "worker-0.log"]  # nothing added
    assert os.stat(state).st_mode & 0o7777 == mode  # not chmod'ed either: the operator decides


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


def everything_below(d) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_a_symlinked_parent_is_refused_naming_it_and_nothing_is_made(tiny_checkpoint, tmp_path):
    """A symlink above the state dir that is not root's (root here makes its own symlinks
    root's, so this one is given to another uid) is refused by name, before anything is
    made below it or at its target."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, NOBODY, NOBODY)
    r = start(link / "new" / "state", tiny_checkpoint)
    assert r.returncode != 0 and f"{link}, above the state dir, is a symlink of uid {NOBODY}" in r.stderr, r.stderr
    assert everything_below(tmp_path) == ["link", "real"]


def make_below_a_symlink_of_ours(home: str) -> dict:
    """Runs as uid 65534 in a directory of its own: the state dir below a symlink it made."""
    home = Path(home)
    (home / "real").mkdir(mode=0o700)
    (home / "link").symlink_to(home / "real")
    try:
        prepare_state_dir(home / "link" / "new" / "state", others_allowed=False)
        return {"accepted": everything_below(home)}
    except StateDirError as e:
        return {"refused": str(e), "left": everything_below(home)}


def test_a_symlinked_parent_of_our_own_is_refused_for_a_user_other_than_root():
    """As ssh's StrictModes: a user's own symlink on the way is no better than anyone else's
    (what made it may change it); only root's are followed."""
    base = Path(tempfile.mkdtemp(prefix="preload-trust-", dir="/tmp"))
    try:
        os.chmod(base, 0o711)
        home = base / "home"
        home.mkdir(mode=0o700)
        os.chown(home, NOBODY, NOBODY)
        got = as_nobody(make_below_a_symlink_of_ours, str(home))
        assert f"{home / 'link'}, above the state dir, is a symlink of uid {NOBODY}" in got.get("refused", ""), got
        assert got["left"] == ["link", "real"], got
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(os.getuid() != 0, reason="a root-owned symlink needs root to make it")
def test_a_root_symlink_above_is_followed_and_its_target_checked_the_same_way(tmp_path):
    """/var/run -> /run is fine: root's symlink, then /run must pass like any directory."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to("real")  # relative, resolved from where it is
    prepare_state_dir(tmp_path / "link" / "a" / "state", others_allowed=False)
    assert (real / "a" / "state").is_dir() and not (real / "a" / "state").is_symlink()

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (tmp_path / "to-shared").symlink_to(shared)
    with pytest.raises(StateDirError) as refused:
        prepare_state_dir(tmp_path / "to-shared" / "b" / "state", others_allowed=False)
    assert f"{shared}, above the state dir, is writable by others" in str(refused.value)
    assert f"through the symlink {tmp_path / 'to-shared'}" in str(refused.value)
    assert not any(shared.iterdir())


def test_nothing_is_made_below_an_ancestor_that_fails(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(StateDirError, match=f"{theirs}, above the state dir, belongs to uid {NOBODY}"):
        prepare_state_dir(theirs / "a" / "b" / "state", others_allowed=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o770)  # group-writable is as bad
    with pytest.raises(StateDirError, match=f"{shared}, above the state dir, is writable by others"):
        prepare_state_dir(shared / "a" / "b" / "state", others_allowed=False)
    assert not any(theirs.iterdir()) and not any(shared.iterdir())


def test_missing_directories_are_made_private_and_a_sticky_one_above_is_fine(tmp_path):
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # as /tmp: others may write, not replace what is ours
    state = sticky / "a" / "b" / "state"
    prepare_state_dir(state, others_allowed=True)
    for d in (sticky / "a", sticky / "a" / "b"):
        assert os.lstat(d).st_mode & 0o7777 == 0o700, d
    assert os.lstat(state).st_mode & 0o7777 == 0o711


@pytest.mark.parametrize("planted", ["their-dir", "a-symlink"])
def test_a_directory_planted_while_we_make_ours_is_refused(tmp_path, monkeypatch, planted):
    """Each directory made is checked again, without following it, before the next: one
    that someone else got in first (or swapped for a symlink) is refused."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    real_mkdir = os.mkdir

    def raced_mkdir(name, mode=0o777, *, dir_fd=None):
        if name == "a":  # the other user wins the race for the first one we make
            if planted == "their-dir":
                real_mkdir(name, 0o755, dir_fd=dir_fd)
                os.chown(name, NOBODY, NOBODY, dir_fd=dir_fd)
            else:
                os.symlink(elsewhere, name, dir_fd=dir_fd)
            raise FileExistsError(name)
        real_mkdir(name, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", raced_mkdir)
    with pytest.raises(StateDirError) as refused:
        prepare_state_dir(tmp_path / "a" / "b" / "state", others_allowed=False)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'a'}, above the state dir, "), message
    assert (f"belongs to uid {NOBODY}" if planted == "their-dir" else "is not a directory") in message
    assert not any(elsewhere.iterdir())


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
