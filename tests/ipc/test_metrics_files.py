"""The workers' metrics directory kept small (ipc/metrics_files.py): a dead process's
files merged into the archives and removed, every sum a scrape serves unchanged (counters
and histograms summed exactly, the dead's live-mode gauges gone), whatever a scrape or a
crash meets in the middle.

The files are written by real processes (forked, prometheus-client in its multiprocess
mode, as a worker's are), with values that add up exactly in floating point."""

from __future__ import annotations

import fcntl
import os
import signal
import threading

import pytest
from metrics_writers import absorbed, collected, counts, write_as_process
from prometheus_client.multiprocess import MultiProcessCollector

from preload.ipc import metrics_files
from preload.ipc.metrics_files import ARCHIVE, _read_archive, absorb, owners


def skipped(directory) -> set[int]:
    """The pids the archives still tell a scrape to skip."""
    return set().union(*(_read_archive(p)[1] for p in directory.glob(f"*_{ARCHIVE}.db")))


@pytest.fixture
def directory(tmp_path):
    d = tmp_path / "metrics"
    d.mkdir()
    return d


@pytest.fixture
def live(directory):
    pids = []
    yield lambda n, worker="live": pids.append(write_as_process(directory, n, worker, stay=True)) or pids[-1]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_dead_processes_are_merged_and_every_sum_stays(directory, live):
    alive = live(16.0)
    dead = [write_as_process(directory, n, f"w{n}") for n in (1.0, 2.0, 4.0)]
    before = collected(directory, MultiProcessCollector(None, path=str(directory)))  # prometheus-client's own
    assert before[("t_requests_total", (("status", "200"), ("worker", "shared")))] == 2 * (16 + 7)

    assert absorb(directory, dead) == 3 * 8  # counter, histogram, summary, 5 gauges each
    assert skipped(directory) == set()
    after = collected(directory)
    assert after == absorbed(before, 16.0)
    # le=1.0: 0.125 and 0.5 * n (n <= 2) of each process: 16 -> 1, 1 -> 2, 2 -> 2, 4 -> 1
    assert after[("t_latency_seconds_bucket", (("le", "1.0"), ("worker", "shared")))] == 6
    assert after[("t_latency_seconds_count", (("worker", "shared"),))] == 16
    assert after[("t_size_sum", ())] == 16.5 + 1.5 + 2.5 + 4.5
    assert after[("t_running", ())] == 16.0 and after[("t_total", ())] == 23.0
    assert after[("t_high", ())] == 16.0 and after[("t_low", ())] == 1.0
    assert owners(directory) == {alive}
    names = sorted(p.name for p in directory.glob("*.db"))
    kinds = ["counter", "gauge_max", "gauge_min", "gauge_mostrecent", "gauge_sum", "histogram", "summary"]
    assert [n for n in names if ARCHIVE in n] == [f"{k}_{ARCHIVE}.db" for k in kinds]
    assert len(names) == len(kinds) + 8  # the archives and the live process's own files


def test_more_deaths_add_to_the_archives(directory):
    first = [write_as_process(directory, n, "0") for n in (1.0, 2.0)]
    absorb(directory, first)
    second = [write_as_process(directory, n, "0") for n in (4.0, 8.0)]
    before = collected(directory)
    absorb(directory, second)
    assert collected(directory) == absorbed(before)
    assert collected(directory)[("t_requests_total", (("status", "200"), ("worker", "0")))] == 15.0
    assert owners(directory) == set()
    assert len(list(directory.glob("*.db"))) == 7  # the archives alone, however many died


def test_a_pid_used_again_after_its_absorb_counts_as_a_new_process(directory):
    dead = write_as_process(directory, 1.0, "0")
    absorb(directory, [dead])
    assert skipped(directory) == set()  # the files are gone: nothing to skip any more
    before = collected(directory)
    other = write_as_process(directory, 2.0, "0")
    for f in directory.glob(f"*_{other}.db"):  # as if the kernel had given it the absorbed pid
        f.rename(directory / f.name.replace(str(other), str(dead)))
    after = collected(directory)
    assert after[("t_requests_total", (("status", "200"), ("worker", "0")))] == 3.0
    assert after[("t_requests_total", (("status", "200"), ("worker", "0")))] > \
        before[("t_requests_total", (("status", "200"), ("worker", "0")))]


def test_absorbing_again_changes_nothing(directory):
    dead = [write_as_process(directory, n, "0") for n in (1.0, 2.0)]
    absorb(directory, dead)
    once = collected(directory)
    assert absorb(directory, dead) == 0
    assert collected(directory) == once


def test_a_crash_between_the_rename_and_the_unlink_counts_nothing_twice(directory, monkeypatch):
    dead = [write_as_process(directory, n, "0") for n in (1.0, 2.0)]
    before = collected(directory)
    expected = absorbed(before)

    def crash(paths):
        paths = list(paths)
        if any("gauge_live" not in p.name for p in paths):
            raise KeyboardInterrupt("the daemon dies here")
        return len([p.unlink() for p in paths])

    monkeypatch.setattr(metrics_files, "_unlink", crash)
    with pytest.raises(KeyboardInterrupt):
        absorb(directory, dead)
    assert owners(directory) == set(dead)  # an archive is in; the dead's files are still there
    assert counts(collected(directory)) == counts(before)  # theirs skipped: counted once, in the archive
    monkeypatch.undo()

    absorb(directory, dead)  # the next daemon: only removes what was absorbed already
    assert owners(directory) == set() and skipped(directory) == set()
    assert collected(directory) == expected


def test_a_crash_after_the_unlink_leaves_pids_to_skip_that_the_next_absorb_forgets(directory, monkeypatch):
    dead = [write_as_process(directory, 1.0, "0")]
    before = collected(directory)
    write = metrics_files._write_archive

    def crash_at_the_last_write(path, values, absorbed):
        if not absorbed:
            raise KeyboardInterrupt("the daemon dies here")
        write(path, values, absorbed)

    monkeypatch.setattr(metrics_files, "_write_archive", crash_at_the_last_write)
    with pytest.raises(KeyboardInterrupt):
        absorb(directory, dead)
    assert skipped(directory) == set(dead)  # (their counter file is gone; the other kinds wait)
    assert counts(collected(directory)) == counts(before)
    monkeypatch.undo()

    absorb(directory, [])  # any absorb forgets the pids whose files are gone
    assert skipped(directory) == set()
    absorb(directory, dead)
    assert owners(directory) == set() and skipped(directory) == set()
    assert collected(directory) == absorbed(before)


def test_a_crash_before_the_rename_leaves_the_old_state(directory, monkeypatch):
    absorb(directory, [write_as_process(directory, 1.0, "0")])
    dead = [write_as_process(directory, 2.0, "0")]
    before = collected(directory)

    def crash(src, dst):
        raise KeyboardInterrupt("the daemon dies here")

    monkeypatch.setattr(metrics_files.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        absorb(directory, dead)
    assert list(directory.glob(".*.tmp"))  # the new archive, never renamed in
    assert counts(collected(directory)) == counts(before)  # (its live gauge may have gone already)
    monkeypatch.undo()

    absorb(directory, dead)
    assert collected(directory) == absorbed(before)


@pytest.mark.parametrize("when", ["after the archives are opened", "between the listing and the read"])
def test_a_scrape_that_meets_an_absorb_reads_again(directory, monkeypatch, when):
    absorb(directory, [write_as_process(directory, 1.0, "0")])  # an archive exists already
    dead = [write_as_process(directory, n, "0") for n in (2.0, 4.0)]
    expected = absorbed(collected(directory))
    calls = {"listdir": 0, "merge": 0}
    listdir, merge = os.listdir, MultiProcessCollector.merge

    def listdir_then_absorb(path):
        calls["listdir"] += 1
        if calls["listdir"] == 2 and when == "after the archives are opened":
            absorb(directory, dead)
        return listdir(path)

    def absorb_then_merge(files, accumulate=True):
        calls["merge"] += 1
        if calls["merge"] == 1 and when == "between the listing and the read":
            absorb(directory, dead)
        return merge(files, accumulate)

    monkeypatch.setattr(metrics_files.os, "listdir", listdir_then_absorb)
    monkeypatch.setattr(MultiProcessCollector, "merge", staticmethod(absorb_then_merge))
    assert collected(directory) == expected
    assert calls["merge"] == 2  # the first read was thrown away


def test_scrapes_while_the_daemon_absorbs_one_by_one_always_see_the_same_sums(directory):
    dead = [write_as_process(directory, 1.0, str(i % 3)) for i in range(40)]
    expected = counts(collected(directory))
    done = threading.Event()

    def daemon():  # as fast as it can: the scrapes fall back to the lock, and absorbs wait for them
        for pid in dead:
            while pid in owners(directory):
                absorb(directory, [pid])
        done.set()

    thread = threading.Thread(target=daemon)
    thread.start()
    scrapes = 0
    while not done.is_set() or scrapes < 3:
        got = collected(directory)
        assert counts(got) == expected, f"scrape {scrapes}"
        scrapes += 1
    thread.join()
    assert owners(directory) == set() and collected(directory) == expected  # (no live gauge left)


def test_an_absorb_never_waits_for_a_scrape_it_leaves_the_files_for_the_next(directory):
    dead = [write_as_process(directory, 1.0, "0")]
    before = collected(directory)
    fd = os.open(directory / metrics_files.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a scrape that fell back to the lock
        assert absorb(directory, dead) == 0
        assert owners(directory) == set(dead) and collected(directory) == before
    finally:
        os.close(fd)
    assert absorb(directory, dead) == 8
    assert collected(directory) == absorbed(before)
