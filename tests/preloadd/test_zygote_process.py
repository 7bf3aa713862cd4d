"""The zygote's wait for the daemon (preloadd/zygote_process.py): a fork request that waits
is served first; until one comes, the idle work (the fronts' HTTP stack, a GPU worker's
Triton kernels) runs a step at a time, and a step that fails ends it, never the zygote."""

from __future__ import annotations

import socket

import pytest

from preload.preloadd.zygote import send
from preload.preloadd.zygote_process import next_request


@pytest.fixture
def channel():
    daemon, zygote = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with daemon, zygote:
        yield daemon, zygote


def test_a_request_waiting_is_served_before_any_idle_work(channel):
    daemon, zygote = channel
    done = []
    send(daemon, {"slot": 3})
    work = [lambda: done.append(1), lambda: done.append(2)]
    assert next_request(zygote, work) == ({"slot": 3}, [])
    assert done == [] and len(work) == 2


def test_idle_work_runs_a_step_at_a_time_until_a_request_comes(channel):
    daemon, zygote = channel
    done = []

    def step(name: str, then_ask: bool = False):
        def run():
            done.append(name)
            if then_ask:
                send(daemon, {"slot": None})
        return run

    work = [step("a"), step("b", then_ask=True), step("c", then_ask=True)]
    assert next_request(zygote, work) == ({"slot": None}, [])
    assert done == ["a", "b"] and len(work) == 1  # the step after the request's arrival waits for the next idle time
    assert next_request(zygote, work) == ({"slot": None}, [])
    assert done == ["a", "b", "c"] and work == []


def test_a_closed_channel_ends_the_wait_without_idle_work(channel):
    daemon, zygote = channel
    work = [lambda: pytest.fail("idle work after the daemon left")]
    daemon.close()
    assert next_request(zygote, work) == (None, [])


def test_a_failed_step_ends_the_idle_work_and_not_the_zygote(channel, capfd):
    daemon, zygote = channel
    done = []

    def fail():
        send(daemon, {"slot": 0})
        raise ImportError("no module named triton")

    work = [fail, lambda: done.append("after")]
    assert next_request(zygote, work) == ({"slot": 0}, [])
    assert done == [] and work == []
    assert "no module named triton" in capfd.readouterr().err
