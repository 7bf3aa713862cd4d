"""Snapshots (experimental, preloadd/snapshot.py), through the real command line: `preload
snapshot DIR` checkpoints a zygote, its imports done, with CRIU; `preload start --restore DIR`
restores that zygote instead of launching one, and whatever stops a restore (no criu, a
host where `criu check` fails, a folder that is no snapshot, one others may change, one of
other code) only costs the start its head start: it serves the same greedy output from a
zygote launched as usual, and /status says why.

The refusals need no CRIU and run everywhere. What needs a working CRIU (4.x here: Debian
12's 3.17 fails `criu check` on this kernel; root) takes it from $PRELOAD_CRIU or PATH and
is skipped, with `criu check`'s own reason, where none passes it.

Every daemon is a real process tree (`preload start`), on the bundled model in float32 on the CPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from daemons import daemon_processes, free_port, preload, running_daemon, wait_for
from supervised import dead, greedy, processes_naming, start_args, wait_replaced, zygotes

from preload import BUNDLED_MODEL
from preload.preloadd.snapshot import SnapshotError, read_meta
from preload.preloadd.install import code_version

MODEL = Path(BUNDLED_MODEL)
DEBIAN_CRIU = "/usr/sbin/criu"  # Debian 12's CRIU 3.17: its `criu check` fails on newer kernels (vDSO)


def criu_errors(output: str) -> list[str]:
    """What CRIU said went wrong: the text of its "Error (file:line): text" lines."""
    return list(dict.fromkeys(m.group(1).strip() for m in re.finditer(r"Error \([^)]*\):\s*(.*)", output)))


def check(criu: str) -> tuple[bool, str]:
    """Whether `criu check` passes, and what it printed."""
    try:
        r = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    return r.returncode == 0, (r.stdout + r.stderr).strip()


def working_criu() -> tuple[str | None, str]:
    """The criu the product would run ($PRELOAD_CRIU, else criu on PATH) if `criu check`
    passes with it; else None and why not, in CRIU's own words."""
    criu = os.environ.get("PRELOAD_CRIU") or shutil.which("criu")
    if not criu:
        return None, "no criu: set $PRELOAD_CRIU or put CRIU 4.x on PATH"
    passes, said = check(criu)
    if not passes:
        return None, f"`{criu} check` fails here: {'; '.join(criu_errors(said)) or said}"
    return criu, said


@pytest.fixture(scope="module")
def criu() -> str:
    path, why = working_criu()
    if path is None:
        pytest.skip(why)
    return path


def serve_args(port: int, *extra) -> tuple:
    return start_args(port, 1, "--device", "cpu", *extra)


def title(pid: int) -> str:
    """A process's title (setproctitle's, padded with NULs to its argv's length)."""
    return " ".join(a for a in psutil.Process(pid).cmdline() if a)


def no_partial_beside(dest: Path) -> bool:
    return not dest.exists() and not list(dest.parent.glob(f".{dest.name}.partial-*"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[str]:
    """The greedy output of a plain start (no --restore) on the bundled model."""
    port = free_port()
    with running_daemon(tmp_path_factory.mktemp("plain") / "state", MODEL, *serve_args(port)):
        return greedy(port)


@dataclass
class Taken:
    dir: Path
    command: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def taken(criu, tmp_path_factory) -> Taken:
    """One snapshot, taken once for the module by `preload snapshot DIR`."""
    base = tmp_path_factory.mktemp("snapshot")
    return Taken(base / "snap", preload("snapshot", base / "snap", timeout=300))


def meta_of(taken: Taken) -> dict:
    assert taken.command.returncode == 0, taken.command.stdout + taken.command.stderr
    return json.loads((taken.dir / "snapshot.json").read_text())


def test_without_criu_a_snapshot_is_refused_naming_the_missing_criu_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PRELOAD_CRIU", "/nonexistent/criu")
    dest = tmp_path / "snap"
    r = preload("snapshot", dest)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no criu here" in r.stderr and "/nonexistent/criu" in r.stderr, r.stderr
    assert no_partial_beside(dest), os.listdir(tmp_path)


def test_with_a_criu_whose_check_fails_a_snapshot_is_refused_with_criu_s_own_reason(tmp_path, monkeypatch):
    if not os.access(DEBIAN_CRIU, os.X_OK):
        pytest.skip(f"no {DEBIAN_CRIU} here")
    passes, said = check(DEBIAN_CRIU)
    if passes:
        pytest.skip(f"`{DEBIAN_CRIU} check` passes on this host")
    # (its first words of its own, past the generic "exited, status=1" of a helper it ran)
    reason = next(e for e in criu_errors(said) if not e.startswith("exited,"))
    monkeypatch.setenv("PRELOAD_CRIU", DEBIAN_CRIU)
    dest = tmp_path / "snap"
    r = preload("snapshot", dest)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"`{DEBIAN_CRIU} check` fails" in r.stderr and reason in r.stderr, (reason, r.stderr)
    assert no_partial_beside(dest), os.listdir(tmp_path)


NEVER_RUN_CRIU = '#!/bin/sh\necho "$@" >> "$(dirname "$0")/criu-was-run"\nexit 1\n'


def test_a_start_whose_restore_cannot_be_used_serves_anyway_and_status_says_why(tmp_path, monkeypatch, plain):
    not_a_snapshot = tmp_path / "empty"
    not_a_snapshot.mkdir()
    # A criu that would say so if it were run: a folder that is no snapshot never gets that far.
    fake = tmp_path / "bin" / "criu"
    fake.parent.mkdir()
    fake.write_text(NEVER_RUN_CRIU)
    fake.chmod(0o755)
    monkeypatch.setenv("PRELOAD_CRIU", str(fake))
    problem = f"{not_a_snapshot} is not a snapshot"
    port = free_port()
    with running_daemon(tmp_path / "state", MODEL, *serve_args(port, "--restore", not_a_snapshot)) as d:
        restore = d.status()["restore"]
        assert restore["from"] == str(not_a_snapshot) and restore["restored"] is False, restore
        assert problem in restore["why"], restore
        shown = preload("status", "--state-dir", d.state_dir).stdout  # (the operator's view says so too)
        assert f"--restore {not_a_snapshot} not used: {problem}" in shown, shown
        assert greedy(port) == plain
    assert not (tmp_path / "bin" / "criu-was-run").exists()


def fake_snapshot(folder: Path) -> Path:
    (folder / "zygote").mkdir(parents=True)
    (folder / "zygote" / "core-1.img").write_bytes(b"\0" * 64)
    (folder / "snapshot.json").write_text(json.dumps({"code_version": code_version(), "pid": 1, "socket": 1}))
    return folder


def loosen_folder(snap: Path) -> Path:
    snap.chmod(0o775)
    return snap


def loosen_image(snap: Path) -> Path:
    (snap / "zygote" / "core-1.img").chmod(0o666)
    return snap / "zygote" / "core-1.img"


def link_meta(snap: Path) -> Path:
    real = snap.parent / "elsewhere.json"
    (snap / "snapshot.json").rename(real)
    (snap / "snapshot.json").symlink_to(real)
    return snap / "snapshot.json"


@pytest.mark.parametrize("loosen", [loosen_folder, loosen_image, link_meta],
                         ids=["group-writable folder", "world-writable image file", "snapshot.json a link"])
def test_a_snapshot_others_may_change_is_refused_its_image_is_code_a_restore_runs(tmp_path, loosen):
    snap = fake_snapshot(tmp_path / "snap")
    assert read_meta(snap)["pid"] == 1  # (as made: ours alone)
    loose = loosen(snap)
    with pytest.raises(SnapshotError, match="may be changed by others") as refused:
        read_meta(snap)
    assert str(loose) in str(refused.value)


def test_a_snapshot_restores_its_zygote_which_serves_as_a_launched_one_would(criu, taken, plain, tmp_path):
    meta = meta_of(taken)
    assert f"--restore {taken.dir}" in taken.command.stdout, taken.command.stdout
    assert meta["code_version"] == code_version() and meta["image_bytes"] > 0 and meta["pid"] > 0, meta
    assert (taken.dir / "zygote").is_dir() and any((taken.dir / "zygote").iterdir())
    assert not list(taken.dir.parent.glob(f".{taken.dir.name}.partial-*"))

    port = free_port()
    with running_daemon(tmp_path / "state", MODEL, *serve_args(port, "--restore", taken.dir)) as d:
        s = d.status()
        assert s["restore"]["from"] == str(taken.dir) and s["restore"]["restored"] is True, s["restore"]
        assert s["restore"]["seconds"] > 0
        assert f"zygote restored from {taken.dir} in " in preload("status", "--state-dir", d.state_dir).stdout
        [zygote] = zygotes(d)
        assert zygote.pid == meta["pid"] and zygote.ppid() == d.pid
        assert title(zygote.pid) == f"preload zygote --state-dir {d.state_dir}"
        assert greedy(port) == plain

        [w] = s["workers"]
        assert title(w["pid"]) == f"preload worker 0 --state-dir {d.state_dir}"
        os.kill(w["pid"], signal.SIGKILL)
        wait_replaced(d, {0: w["pid"]})
        assert [z.pid for z in zygotes(d)] == [meta["pid"]] and d.status()["zygote_restarts"] == 0  # (its fork)
        assert greedy(port) == plain

        stop = preload("stop", "--state-dir", d.state_dir)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert wait_for(lambda: not processes_naming(d.state_dir) and not daemon_processes(d.state_dir), timeout=15), \
            [title(p.pid) for p in processes_naming(d.state_dir)]
        assert dead(meta["pid"])
        log = (Path(d.state_dir) / "daemon.log").read_text()
        assert "Traceback" not in log and "starting a new one" not in log  # (its end reaped as a launched one's)


def test_a_snapshot_of_other_code_is_refused_and_the_start_serves_anyway(criu, taken, plain, tmp_path):
    meta = meta_of(taken)
    other = tmp_path / "other-code"
    shutil.copytree(taken.dir, other)  # (copy2: modes kept, ours alone as the original)
    (other / "snapshot.json").write_text(json.dumps(meta | {"code_version": "0" * 64}))
    port = free_port()
    with running_daemon(tmp_path / "state", MODEL, *serve_args(port, "--restore", other)) as d:
        restore = d.status()["restore"]
        assert restore["from"] == str(other) and restore["restored"] is False, restore
        assert "other code" in restore["why"], restore
        [launched] = zygotes(d)
        assert launched.pid != meta["pid"]
        assert greedy(port) == plain
