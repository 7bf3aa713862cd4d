"""A slot's crash-loop bookkeeping (preloadd/workers.Slot): early exits in a row back off,
whether the worker never got ready or failed of its own soon after it did; a ready worker
killed by a signal, or one that served long enough, ends the streak; /status shows no
streak while a ready worker serves."""

from __future__ import annotations

import time
from types import SimpleNamespace

from preload.preloadd.workers import STABLE_AFTER, Slot


def worker(state: str, age: float = 0.0):
    """What record_exit reads of a worker: when it started, and how far it got."""
    return SimpleNamespace(since=time.monotonic() - age, state=state)


def test_workers_that_never_get_ready_back_off_more_each_time():
    slot = Slot()
    delays = [slot.record_exit(worker("starting"), "exited with status 1", own=True) for _ in range(4)]
    assert delays == [0.0, 0.2, 0.4, 0.8] and slot.failures == 4 and slot.vacancy() == "backoff"


def test_a_worker_failing_of_its_own_soon_after_ready_carries_the_streak_on():
    """The GPU case that crash-looped at 0.6 s a turn: each worker ready, then dead (exit
    status 1) in its idle work; before, each ready reset the count and nothing backed off."""
    slot, delays = Slot(), []
    for _ in range(4):
        slot.ready()
        assert slot.failures == 0  # (/status while it serves: no crash loop shown)
        delays.append(slot.record_exit(worker("ready"), "exited with status 1", own=True))
    assert delays == [0.0, 0.2, 0.4, 0.8] and slot.failures == 4


def test_a_ready_worker_killed_or_long_lived_ends_the_streak():
    slot = Slot()
    for _ in range(3):
        slot.record_exit(worker("starting"), "exited with status 1", own=True)
    slot.ready()
    assert slot.record_exit(worker("ready"), "killed by SIGKILL") == 0.0 and slot.failures == 0  # (a kill: no loop)
    for _ in range(3):
        slot.record_exit(worker("starting"), "exited with status 1", own=True)
    slot.ready()
    assert slot.record_exit(worker("ready", age=STABLE_AFTER + 1), "exited with status 1", own=True) == 0.0
    assert slot.failures == 0
