"""Rolling restarts (`preload restart`, preloadd/rolling.py) through the real command
line: under fresh, keep-alive and streamed load none fails (the fronts hold the clients;
only the engine cores are replaced); a second restart while the first drains; the next
slots' replacements warm while the current one does, as many as the spares retired at the
start left room for, and without spares one slot after another."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

import httpx
import psutil
import pytest
from daemons import free_port, preload, running_daemon, wait_for
from supervised import (
    PROMPT,
    REPLACE_TIMEOUT,
    api,
    children,
    complete,
    dead,
    logs,
    slot_pids,
    start_args,
    wait_replaced,
    workers_of,
    zygotes,
)


# ---- graceful rolling restart under load ---------------------------------------------------


class Load:
    """Client threads sending completions in a loop until stopped; every failure is kept."""

    def __init__(self, port: int):
        self.port = port
        self.stop = threading.Event()
        self.ok = Counter()
        self.failures: list[str] = []
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _record(self, kind: str, error: str | None) -> None:
        with self._lock:
            if error is None:
                self.ok[kind] += 1
            else:
                self.failures.append(f"{kind}: {error}")

    def _loop(self, kind: str, send) -> None:
        while not self.stop.is_set():
            try:
                send()
                self._record(kind, None)
            except (AssertionError, httpx.HTTPError) as e:
                self._record(kind, f"{type(e).__name__}: {e}")

    def fresh(self) -> None:
        """A new TCP connection per request."""
        self._spawn("fresh", lambda: complete(self.port))

    def pooled(self, client: httpx.Client) -> None:
        """Requests over a shared keep-alive pool."""
        self._spawn("keep-alive", lambda: complete(self.port, client))

    def streamed(self) -> None:
        """Streamed completions, each of which must end with [DONE]."""

        def send() -> None:
            body = {"prompt": PROMPT, "max_tokens": 32, "ignore_eos": True, "stream": True, "temperature": 0}
            with httpx.stream("POST", api(self.port) + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200, f"{r.status_code}: {r.read()!r}"
                data = [ln[5:].strip() for ln in r.iter_lines() if ln.startswith("data:")]
            assert data and data[-1] == "[DONE]", f"stream ended without [DONE] after {len(data)} events"

        self._spawn("stream", send)

    def _spawn(self, kind: str, send) -> None:
        t = threading.Thread(target=self._loop, args=(kind, send), daemon=True)
        self.threads.append(t)
        t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads), "a client thread hung"

    def total(self) -> int:
        with self._lock:
            return sum(self.ok.values()) + len(self.failures)


ROLLING_ROUNDS = 4  # `preload restart`s in a row (issue 36's run: 200, with 2 of 1,185 requests reset; bench serve)


def test_graceful_rolling_restart_under_load_drops_no_request(tiny_checkpoint, tmp_path):
    """Rolling restarts one after another while fresh, keep-alive and streamed requests
    run: none fails (the fronts hold the clients; only the engine cores are replaced)."""
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2)) as d:
        before = {w["slot"]: w["pid"] for w in workers_of(d)}
        assert len(before) == 2
        with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=4)) as pool:
            load = Load(port)
            try:
                load.fresh()
                load.fresh()
                load.pooled(pool)
                load.pooled(pool)
                load.streamed()
                assert wait_for(lambda: load.total() >= 20, timeout=60), "the load never got going"
                for _ in range(ROLLING_ROUNDS):
                    r = preload("restart", "--state-dir", d.state_dir, "--timeout", 120, timeout=180)
                    assert r.returncode == 0, r.stdout + r.stderr + logs(d.state_dir)
                during = load.total()
                assert wait_for(lambda: load.total() >= during + 20, timeout=60)
            finally:
                load.join()
        assert not load.failures, f"{len(load.failures)} of {load.total()} requests failed: {load.failures[:10]}"
        assert all(load.ok[k] > 0 for k in ("fresh", "keep-alive", "stream")), load.ok

        after = workers_of(d)
        for w in after:
            assert w["pid"] != before[w["slot"]] and w["state"] == "ready", after
            assert w["restarts"] == ROLLING_ROUNDS, after
            assert w["last_exit"] == "exited with status 0", f"a drained worker exits cleanly: {after}"
        assert all(dead(p) for p in before.values())
        assert wait_for(lambda: len(children(d.pid)) == 5, timeout=30)  # 2 workers, their fronts, the zygote


def test_a_restart_says_when_the_checkpoint_changed_on_disk(tiny_checkpoint, tmp_path):
    """Issue 36: `preload restart` kept serving the old weights without a word after a
    checkpoint file was replaced on disk. It restarts the workers on the weights the
    daemon holds (a restart loads nothing) and says which files changed, and how to load
    them; with nothing changed it says nothing of the kind."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    port = free_port()
    with running_daemon(tmp_path / "state", model, *start_args(port)) as d:
        fingerprint = d.status()["fingerprint"]
        same = preload("restart", "--state-dir", d.state_dir, "--timeout", 120, timeout=180)
        assert same.returncode == 0 and "changed on disk" not in same.stderr, same.stdout + same.stderr
        (weights,) = model.glob("*.safetensors")
        replaced = weights.with_name("replaced.tmp")
        shutil.copy(weights, replaced)
        replaced.replace(weights)  # (same bytes, a new file: as a deploy that copies a checkpoint over)
        r = preload("restart", "--state-dir", d.state_dir, "--timeout", 120, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"the checkpoint changed on disk since the daemon loaded it ({weights.name})" in r.stderr, r.stderr
        assert "`preload stop` and `preload start` load the files as they are now" in r.stderr
        assert d.status()["fingerprint"] == fingerprint
        assert f"restart: the checkpoint changed on disk since the load ({weights.name})" in (d.state_dir / "daemon.log").read_text()
        assert complete(port)["choices"][0]["text"]


@pytest.fixture(scope="module")
def long_context_checkpoint(tmp_path_factory):
    """The tiny model with a 16k-token context: room for a stream that lasts a while."""
    from checkpoints import CASES, make_hf_model, save_hf_model

    arch, overrides = CASES["v3-no-qlora-one-group"]
    model = make_hf_model(arch, seed=5, **(overrides | {"max_position_embeddings": 16384}))
    return save_hf_model(model, tmp_path_factory.mktemp("long-context-v3"))


def test_a_second_rolling_restart_while_the_first_drains(long_context_checkpoint, tmp_path):
    """`preload restart` returns once the replacements are ready; the old core hands its
    requests to the new one (the slot's front holds them: issue 33) and exits. A second
    `preload restart` right after replaces the live core only: the stream goes on across
    both (no error, no cut) and no slot ends up with two workers, one of them invisible in
    /status. (Before the front/core split the old worker drained its stream itself, and the
    test asked that the second restart leave it alone.)"""
    port = free_port()
    with running_daemon(tmp_path / "state", long_context_checkpoint, *start_args(port)) as d:
        [a] = workers_of(d)
        body = {"prompt": PROMPT, "max_tokens": 16000, "ignore_eos": True, "stream": True, "temperature": 0}
        stream: dict = {"events": 0}
        hang_up = threading.Event()

        def read_stream() -> None:
            try:
                with httpx.stream("POST", api(port) + "/v1/completions", json=body, timeout=300) as r:
                    for line in r.iter_lines():
                        stream["events"] += line.startswith("data:")
                        if line.strip() == "data: [DONE]":
                            stream["done"] = True
                        if hang_up.is_set():
                            return  # closing the connection aborts the request
            except httpx.HTTPError as e:
                stream["error"] = f"{type(e).__name__}: {e}"

        reader = threading.Thread(target=read_stream, daemon=True)
        reader.start()
        try:
            assert wait_for(lambda: stream["events"] >= 5, timeout=60), stream
            r1 = preload("restart", "--state-dir", d.state_dir, "--timeout", REPLACE_TIMEOUT)
            assert r1.returncode == 0, r1.stdout + r1.stderr + logs(d.state_dir)
            r2 = preload("restart", "--state-dir", d.state_dir, "--timeout", REPLACE_TIMEOUT)
            assert r2.returncode == 0, r2.stdout + r2.stderr + logs(d.state_dir)
            # The stream still flows several seconds later, handed from core to core.
            before = stream["events"]
            time.sleep(3)
            assert "error" not in stream and "done" not in stream and reader.is_alive(), (
                f"the stream was cut: {stream}\n{logs(d.state_dir)}")
            assert stream["events"] > before, f"the stream stalled after the restarts: {stream}\n{logs(d.state_dir)}"
        finally:
            hang_up.set()
            reader.join(60)

        # The old cores are gone. What remains is one worker, the one /status shows, and the zygote.
        assert wait_for(lambda: not psutil.pid_exists(a["pid"]), timeout=REPLACE_TIMEOUT), logs(d.state_dir)
        [w] = workers_of(d)
        assert w["restarts"] == 2 and w["state"] == "ready", w

        def live_workers():
            zs = {z.pid for z in zygotes(d)}
            return sorted(c.pid for c in children(d.pid) if c.pid not in zs)

        assert wait_for(lambda: live_workers() == slot_pids(d), timeout=15), (
            f"workers alive: {live_workers()}, /status shows {workers_of(d)}\n{logs(d.state_dir)}")


# ---- replacements warming together ------------------------------------------------------------


def forks_and_takeovers(log: str, old_pids: set[int]) -> list[tuple[str, int]]:
    """The daemon log's replacement forks and takeovers, in order: ("fork", slot) and
    ("takeover", slot), for the cores that replace `old_pids`."""
    events = []
    for line in log.splitlines():
        if m := re.search(r"worker (\d+) started \(pid \d+\)", line):
            events.append(("fork", int(m[1])))
        elif (m := re.search(r"worker (\d+): pid \d+ takes over from pid (\d+)", line)) and int(m[2]) in old_pids:
            events.append(("takeover", int(m[1])))
    return events


def restart_events(d, workers: int) -> list[tuple[str, int]]:
    old = {w["slot"]: w["pid"] for w in workers_of(d)}
    assert len(old) == workers
    mark = len((d.state_dir / "daemon.log").read_text())
    r = preload("restart", "--state-dir", d.state_dir, "--timeout", 120, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr + logs(d.state_dir)
    wait_replaced(d, old)
    return forks_and_takeovers((d.state_dir / "daemon.log").read_text()[mark:], set(old.values()))


def test_with_a_spare_the_next_slots_replacement_warms_beside_the_first(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2, "--spare-workers", 1)) as d:
        assert wait_for(lambda: [s for s in d.status()["spares"] if s["state"] == "standby"], timeout=60)
        greedy = complete(port, max_tokens=12)["choices"][0]["text"]
        events = restart_events(d, 2)
        assert events[:2] == [("fork", 0), ("fork", 1)], events  # (slot 1's fork before slot 0 took over)
        assert {e for e in events if e[0] == "takeover"} == {("takeover", 0), ("takeover", 1)}, events
        assert complete(port, max_tokens=12)["choices"][0]["text"] == greedy


def test_without_spares_one_slot_after_another(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2, "--spare-workers", 0)) as d:
        greedy = complete(port, max_tokens=12)["choices"][0]["text"]
        events = restart_events(d, 2)
        assert events == [("fork", 0), ("takeover", 0), ("fork", 1), ("takeover", 1)], events
        assert complete(port, max_tokens=12)["choices"][0]["text"] == greedy
