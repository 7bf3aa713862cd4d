"""The daemon's side of the workers' metrics dir (preloadd/health.py): a reaped worker's
files absorbed as it is reaped, and a starting daemon's dir made coherent: the files of
workers that died while no daemon watched absorbed when others live on to be adopted
(their sums never go down), everything gone when none does (the counts start anew)."""

from __future__ import annotations

import os
import signal

import pytest
from metrics_writers import absorbed, collected, counts, write_as_process

from preload.ipc.metrics_files import absorb, owners
from preload.preloadd.health import prepare_metrics_dir, worker_gone
from preload.preloadd.state_dir import MULTIPROC_ENV


@pytest.fixture
def directory(tmp_path):
    d = tmp_path / "metrics"
    d.mkdir()
    return d


def test_a_reaped_worker_is_absorbed_and_so_is_any_other_dead(directory, monkeypatch):
    monkeypatch.setenv(MULTIPROC_ENV, str(directory))
    alive = write_as_process(directory, 8.0, "0", stay=True)
    try:
        reaped, unwatched = (write_as_process(directory, n, "0") for n in (1.0, 2.0))
        before = collected(directory)
        worker_gone(reaped)
        assert owners(directory) == {alive}
        assert collected(directory) == absorbed(before, 8.0)
    finally:
        os.kill(alive, signal.SIGKILL)
        os.waitpid(alive, 0)


def test_a_worker_gone_without_a_metrics_dir_is_nothing_to_do(monkeypatch):
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    worker_gone(os.getpid())


def test_a_starting_daemon_absorbs_those_that_died_unwatched_while_others_live_on(directory):
    absorb(directory, [write_as_process(directory, 1.0, "0")])  # the last daemon's archive
    alive = write_as_process(directory, 8.0, "1", stay=True)  # a worker to adopt
    try:
        dead = [write_as_process(directory, n, "0") for n in (2.0, 4.0)]  # died while no daemon watched
        (directory / ".counter_dead.db.tmp").write_bytes(b"")  # an absorb the last daemon did not finish
        before = collected(directory)
        prepare_metrics_dir(directory)
        assert owners(directory) == {alive} and not set(dead) & owners(directory)
        assert collected(directory) == absorbed(before, 8.0)
        assert not list(directory.glob(".*.tmp"))
    finally:
        os.kill(alive, signal.SIGKILL)
        os.waitpid(alive, 0)


def test_a_starting_daemon_with_no_survivor_starts_the_counts_anew(directory):
    absorb(directory, [write_as_process(directory, 1.0, "0")])
    write_as_process(directory, 2.0, "0")
    assert counts(collected(directory))
    prepare_metrics_dir(directory)
    assert list(directory.iterdir()) == []


def test_a_starting_daemon_makes_the_dir(tmp_path):
    prepare_metrics_dir(tmp_path / "metrics")
    assert (tmp_path / "metrics").stat().st_mode & 0o777 == 0o700
