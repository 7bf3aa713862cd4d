"""Supervised workers through the real command line (issue 5): `preload start --workers N
--port P` runs the daemon, a zygote and N workers that share the daemon's listening
socket; a worker that dies is replaced at once, a crash loop backs off, and the zygote
comes back when it dies. Rolling restarts are in test_rolling.py, warm spares in
test_spares.py.

Every daemon here is a real process tree started by `preload start` (see daemons.py),
on tiny random checkpoints in float32; clients are plain httpx. Nothing is timed
against a figure: restart times are the business of `preload bench restart`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections import Counter

import httpx
import psutil
import pytest
from daemons import arena_holders, arena_inodes, free_port, metrics, port_is_free, preload, running_daemon, total, wait_for
from supervised import (
    PROMPT,
    REPLACE_TIMEOUT,
    api,
    children,
    complete,
    dead,
    kill,
    logs,
    processes_naming,
    slot_pids,
    start_args,
    wait_replaced,
    workers_of,
    zombies,
    zygotes,
)

# ---- SIGKILL mid-stream --------------------------------------------------------------------


def stream(port: int, body: dict, on_event=None) -> tuple[list[str], Exception | None]:
    """The data events of a streamed completion (`on_event(events)` after each), and the
    error that cut it, if one did."""
    events, error = [], None
    try:
        with httpx.stream("POST", api(port) + "/v1/completions", json=body | {"stream": True}, timeout=60) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if on_event is not None:
                        on_event(events)
    except httpx.HTTPError as e:  # the connection broke mid-body: an error the client sees
        error = e
    return events, error


def text_of(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e.startswith("{") and json.loads(e)["choices"])


def test_sigkill_of_the_engine_core_mid_stream_costs_the_stream_nothing(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port)) as d:
        before = d.status()
        [w] = before["workers"]
        assert w["state"] == "ready" and w["restarts"] == 0 and w["last_exit"] is None, w
        n_tokens = 120
        body = {"prompt": PROMPT, "max_tokens": n_tokens, "ignore_eos": True, "temperature": 0}
        whole = complete(port, max_tokens=n_tokens)["choices"][0]["text"]
        events, error = stream(port, body, lambda ev: kill(w["pid"]) if len(ev) == 3 else None)
        assert error is None and events[-1] == "[DONE]", error
        assert text_of(events) == whole  # every piece once, none missing: the uninterrupted greedy text

        after = d.status()
        [w2] = after["workers"]
        assert w2["pid"] != w["pid"] and w2["state"] == "ready", w2
        assert w2["restarts"] == 1 and w2["last_exit"] == "killed by SIGKILL", w2
        assert w2["front"]["pid"] == w["front"]["pid"] and w2["front"]["restarts"] == 0  # the front held on
        assert after["fingerprint"] == before["fingerprint"] and after["state"] == "ready"
        assert d.get("/health").status_code == 200
        assert dead(w["pid"])


def test_the_next_core_takes_up_the_blocks_a_killed_one_computed(tiny_checkpoint, tmp_path):
    """Issue 33: a request handed over after its core's SIGKILL (100 prompt tokens, 24
    generated) finds its full blocks in the slot's KV memory (block_ledger.py): the new
    core computes again only the tail, and the text is the uninterrupted one's. (Its
    uninterrupted twin has another cache_salt, so that nothing else could share them.)"""
    port = free_port()
    prompt = [5 + i % 90 for i in range(100)]
    body = {"prompt": prompt, "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port)) as d:
        [w] = d.status()["workers"]
        whole = httpx.post(api(port) + "/v1/completions", json=body | {"cache_salt": "twin"}, timeout=60).json()
        def hits():
            return total(metrics(httpx.get(api(port) + "/metrics", timeout=10).text), "preload_prefix_cache_hits_total")

        before = hits()
        events, error = stream(port, body | {"cache_salt": "killed"}, lambda ev: kill(w["pid"]) if len(ev) == 24 else None)
        assert error is None and events[-1] == "[DONE]", error
        assert text_of(events) == whole["choices"][0]["text"]
        assert d.status()["workers"][0]["restarts"] == 1
        deadline = time.monotonic() + 10
        while hits() - before < 96:  # (six blocks of 16 at least; a beat brings the figure)
            assert time.monotonic() < deadline, "the new core found none of the killed core's blocks"
            time.sleep(0.1)


def test_sigkill_of_the_front_mid_stream_truncates_that_stream_only(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port)) as d:
        [w] = d.status()["workers"]
        greedy = complete(port, max_tokens=16)["choices"][0]["text"]
        max_len = httpx.get(api(port) + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        n_tokens = max_len - len(PROMPT.split())
        body = {"prompt": PROMPT, "max_tokens": n_tokens, "ignore_eos": True, "temperature": 0}
        events, error = stream(port, body, lambda ev: kill(w["front"]["pid"]) if len(ev) == 3 else None)
        assert "[DONE]" not in events, f"a stream cut by SIGKILL must not end as if complete ({error!r})"
        assert len(text_of(events).split()) < n_tokens

        # The next request waits in the daemon's backlog for the new front and succeeds.
        assert complete(port, max_tokens=16)["choices"][0]["text"] == greedy
        [w2] = d.status()["workers"]
        assert w2["front"]["pid"] != w["front"]["pid"] and w2["front"]["restarts"] == 1, w2
        assert w2["front"]["last_exit"] == "killed by SIGKILL", w2
        assert w2["pid"] == w["pid"] and w2["restarts"] == 0  # the core served on
        assert dead(w["front"]["pid"])
        # `preload status --json` tells the same story as /status.
        cli = preload("status", "--state-dir", d.state_dir, "--json")
        assert cli.returncode == 0, cli.stderr
        [w3] = json.loads(cli.stdout)["workers"]
        f = w3["front"]
        assert (f["pid"], f["restarts"], f["last_exit"]) == (w2["front"]["pid"], 1, "killed by SIGKILL")


def test_requests_sent_while_a_worker_restarts_wait_and_succeed(tiny_checkpoint, tmp_path):
    """The daemon keeps the API socket open across a worker's death, so a client that
    connects meanwhile waits in the backlog and gets a real answer: never a refusal, and
    never a 503 from a replacement that is up but not ready yet. A new client connects
    every 5 ms from the kill until one has been answered; over 15 restarts (the window in
    which a replacement could answer too early is short on an idle CPU, so one restart
    alone may not hit it)."""
    port = free_port()
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port)) as d:
        for cycle in range(15):
            [w] = workers_of(d)
            results: list[str] = []
            done = threading.Event()

            def send() -> None:
                try:
                    with httpx.Client(timeout=60) as client:  # an independent client, its own connection
                        r = client.post(api(port) + "/v1/completions", json=body)
                    results.append("ok" if r.status_code == 200 else f"{r.status_code}: {r.text}")
                except httpx.HTTPError as e:
                    results.append(f"{type(e).__name__}: {e}")
                if results[-1] == "ok":
                    done.set()

            kill(w["pid"])
            threads = []
            deadline = time.monotonic() + REPLACE_TIMEOUT
            while not done.is_set() and time.monotonic() < deadline:
                threads.append(threading.Thread(target=send, daemon=True))
                threads[-1].start()
                time.sleep(0.005)
            for t in threads:
                t.join(60)
            bad = [r for r in results if r != "ok"]
            assert done.is_set() and not bad, f"restart {cycle + 1}: {len(bad)} of {len(results)} requests failed: {bad[:3]}"
            wait_replaced(d, {0: w["pid"]})


# ---- 50 kill/restart cycles ----------------------------------------------------------------


def test_fifty_kill_restart_cycles_leak_nothing(tiny_checkpoint, tmp_path):
    port = free_port()
    cycles, checkpoint_at = 50, 5
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port)) as d:
        daemon = psutil.Process(d.pid)
        s = d.status()
        fingerprint = s["fingerprint"]
        baseline = None
        for i in range(1, cycles + 1):
            [w] = workers_of(d)
            kill(w["pid"])
            [w2] = wait_replaced(d, {0: w["pid"]})
            assert w2["restarts"] == i and w2["last_exit"] == "killed by SIGKILL", w2
            if i == checkpoint_at:
                baseline = (daemon.num_fds(), daemon.memory_info().rss)
        fds, rss = daemon.num_fds(), daemon.memory_info().rss
        assert fds <= baseline[0] + 16, f"daemon fds grew from {baseline[0]} to {fds} over {cycles - checkpoint_at} cycles"
        assert rss <= baseline[1] + 64 * 2**20, f"daemon RSS grew from {baseline[1]} to {rss}"

        # One worker, its front and one zygote, no zombies; only the daemon, its keeper and the live worker
        # hold the arena (a front never maps it).
        assert wait_for(lambda: len(children(d.pid)) == 3, timeout=30), [c.cmdline()[:3] for c in children(d.pid)]
        assert zombies(d.pid) == []
        [w] = workers_of(d)
        assert set(arena_holders(arena_inodes(d.pid))) == {d.pid, s["keeper_pid"], w["pid"]}
        s = d.status()
        assert s["fingerprint"] == fingerprint and s["state"] == "ready"
        assert len(s["attached_workers"]) <= 1, s["attached_workers"]
        complete(port)

        # `preload restart --now` still works after all that.
        r = preload("restart", "--state-dir", d.state_dir, "--now", "--timeout", REPLACE_TIMEOUT)
        assert r.returncode == 0, r.stdout + r.stderr + logs(d.state_dir)
        [w2] = workers_of(d)
        assert w2["pid"] != w["pid"] and w2["state"] == "ready", w2
        assert w2["restarts"] == cycles + 1, w2
        complete(port)


def test_status_answers_throughout_restarts(tiny_checkpoint, tmp_path):
    """Dashboards and `preload restart` poll /status while workers come and go (each one
    attaches and lets go of the weights): every poll must be answered, never a 500."""
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 2)) as d:
        stop = threading.Event()
        answers: Counter = Counter()

        def poll(path: str) -> None:
            with httpx.Client(timeout=30) as c:
                while not stop.is_set():
                    try:
                        answers[c.get(d.url + path).status_code] += 1
                    except httpx.HTTPError as e:
                        answers[type(e).__name__] += 1

        pollers = [threading.Thread(target=poll, args=(p,), daemon=True) for p in ("/status", "/status", "/health")]
        for t in pollers:
            t.start()
        try:
            for _ in range(5):
                ws = workers_of(d)
                for w in ws:
                    kill(w["pid"])
                wait_replaced(d, {w["slot"]: w["pid"] for w in ws})
            r = preload("restart", "--state-dir", d.state_dir, "--timeout", REPLACE_TIMEOUT)
            assert r.returncode == 0, r.stdout + r.stderr
        finally:
            stop.set()
            for t in pollers:
                t.join(30)
        assert set(answers) == {200}, f"{answers}\n{logs(d.state_dir)}"


# ---- zygote death --------------------------------------------------------------------------


def test_zygote_death_workers_keep_serving_and_it_comes_back(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port)) as d:
        [z] = zygotes(d)
        [w] = workers_of(d)
        renewed = d.status()["zygote_restarts"]
        kill(z.pid)
        assert wait_for(lambda: dead(z.pid), timeout=10)

        # The worker does not depend on its zygote.
        complete(port)
        assert workers_of(d)[0]["pid"] == w["pid"]

        # A new zygote comes up; the dead one is reaped, not left a zombie.
        assert wait_for(lambda: d.status()["zygote_restarts"] > renewed, timeout=REPLACE_TIMEOUT), logs(d.state_dir)
        new = wait_for(lambda: zygotes(d), timeout=REPLACE_TIMEOUT)
        assert new and z.pid not in {p.pid for p in new}, new
        assert z.pid not in zombies(d.pid)
        assert d.get("/health").status_code == 200

        # ... and it forks replacements.
        kill(w["pid"])
        [w2] = wait_replaced(d, {0: w["pid"]})
        complete(port)

        # Zygote and worker dead at once: the worker is back once a new zygote is.
        [z2] = wait_for(lambda: zygotes(d), timeout=REPLACE_TIMEOUT)
        renewed = d.status()["zygote_restarts"]
        kill(z2.pid)
        kill(w2["pid"])
        [w3] = wait_replaced(d, {0: w2["pid"]})
        assert w3["restarts"] == 2, w3
        assert d.status()["zygote_restarts"] > renewed
        complete(port)
        assert wait_for(lambda: len(children(d.pid)) == 3, timeout=30), [c.cmdline()[:3] for c in children(d.pid)]
        assert zombies(d.pid) == []


def test_a_cold_starts_zygote_imports_while_the_daemon_itself_starts(tiny_checkpoint, tmp_path):
    """The first zygote is launched before the daemon imports its own modules, binds its
    ports and plans its load (cli/start.py): its imports, a first worker's longest wait on a
    cold start, overlap all of that as well as the load."""
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port)) as d:
        [z] = zygotes(d)
        lines = (d.state_dir / "daemon.log").read_text().splitlines()
        launched = [i for i, line in enumerate(lines) if f"zygote launched (pid {z.pid})" in line]
        opened = [i for i, line in enumerate(lines) if " INFO health port " in line]
        assert len(launched) == len(opened) == 1 and launched[0] < opened[0], lines
        assert any(re.search(rf"zygote ready \(pid {z.pid}\) [0-9.]+ s after its launch", line) for line in lines), lines
        complete(port)


def test_a_start_that_fails_before_its_workers_leaves_no_zygote(tiny_checkpoint, tmp_path):
    """A zygote launched for a start that then fails (its health port taken) is killed and
    reaped with it, not left to finish its imports."""
    state_dir = tmp_path / "state"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = preload("start", "--model", tiny_checkpoint, "--state-dir", state_dir, "--health-port",
                    taken.getsockname()[1], *start_args(free_port()))
    try:
        assert r.returncode != 0 and "in use" in r.stderr.lower(), r.stderr
        # (the daemon reports its failure, then reaps the zygote: a moment; its imports alone take seconds)
        assert wait_for(lambda: not processes_naming(state_dir), timeout=1.0), processes_naming(state_dir)
    finally:
        for p in processes_naming(state_dir):
            p.kill()


def test_without_zygote_workers_are_fresh_processes_and_still_replaced(tiny_checkpoint, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port, 1, "--no-zygote")) as d:
        [w] = workers_of(d)
        assert zygotes(d) == [] and sorted(c.pid for c in children(d.pid)) == slot_pids(d)
        complete(port)
        kill(w["pid"])
        [w2] = wait_replaced(d, {0: w["pid"]})
        assert (w2["restarts"], w2["last_exit"]) == (1, "killed by SIGKILL"), w2
        complete(port)
        assert wait_for(lambda: sorted(c.pid for c in children(d.pid)) == slot_pids(d), timeout=30)
        assert zombies(d.pid) == []


# ---- crash loop ----------------------------------------------------------------------------


def test_start_with_workers_that_cannot_start_fails_and_leaves_nothing(tiny_checkpoint, tmp_path):
    """A KV cache budget too small for one block: the engine refuses, so the worker exits
    at start. `preload start` must say so (pointing at the worker logs) and clean up."""
    state_dir, port, health = tmp_path / "state", free_port(), free_port()
    r = preload("start", "--model", tiny_checkpoint, "--state-dir", state_dir, "--health-port", health,
                *start_args(port, 1, "--kv-cache-memory", "1"))
    try:
        assert r.returncode != 0, r.stdout
        assert "worker" in r.stderr and str(state_dir) in r.stderr, r.stderr
        # The log it points at says why.
        assert "holds no block" in (state_dir / "worker-0.log").read_text(), logs(state_dir)
        assert wait_for(lambda: not processes_naming(state_dir), timeout=15), processes_naming(state_dir)
        assert port_is_free(port) and port_is_free(health)
        assert not list(state_dir.glob("*.sock"))
    finally:
        for p in processes_naming(state_dir):
            p.kill()


@pytest.fixture(scope="module")
def unrunnable_checkpoint(tmp_path_factory):
    """A checkpoint the daemon loads but the engine cannot run: DeepseekV3Config's default
    8 expert groups over 8 experts leave one expert per group, and group scoring takes
    the top 2 of each group, so the very first forward pass raises."""
    from checkpoints import make_hf_model, save_hf_model

    return save_hf_model(make_hf_model("v3", seed=1), tmp_path_factory.mktemp("unrunnable-v3"))


def test_worker_whose_engine_fails_its_warm_up_is_a_failed_start(unrunnable_checkpoint, tmp_path):
    """A worker whose engine dies on the warm-up request can never become ready: it must
    exit (so that start fails, or the supervisor backs off), not sit in "starting" with
    `preload start` waiting for its full ready timeout."""
    state_dir, port, health = tmp_path / "state", free_port(), free_port()
    try:
        r = preload("start", "--model", unrunnable_checkpoint, "--state-dir", state_dir, "--health-port", health,
                    *start_args(port), timeout=90)
        assert r.returncode != 0, r.stdout
        assert "worker" in r.stderr and str(state_dir) in r.stderr, r.stderr
        assert "out of range" in (state_dir / "worker-0.log").read_text(), logs(state_dir)
        assert wait_for(lambda: not processes_naming(state_dir), timeout=15), processes_naming(state_dir)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`preload start` still waiting after 90 s for a worker whose engine failed:\n{logs(state_dir)}")
    finally:
        for p in processes_naming(state_dir):
            p.kill()


def test_crash_loop_backs_off_shows_in_status_and_recovers(tiny_checkpoint, tmp_path):
    """Workers that fail at start: the fd socket they attach through is taken away (as a
    /tmp cleaner might), so every replacement exits before it is ready. The supervisor
    must back off (not spin), say so in /status, keep the daemon healthy, and recover
    once the socket is back."""
    port = free_port()
    with running_daemon(tmp_path / "state", tiny_checkpoint, *start_args(port)) as d:
        fds_sock = d.state_dir / "fds.sock"
        hidden = d.state_dir / "fds.sock.hidden"
        [w] = workers_of(d)
        os.rename(fds_sock, hidden)
        try:
            kill(w["pid"])
            seen = set()

            def looping():
                [s] = workers_of(d)
                seen.add(s["state"])
                return s if s["consecutive_failures"] >= 5 and "backoff" in seen else None

            s = wait_for(looping, timeout=REPLACE_TIMEOUT, interval=0.02)
            assert s, f"no crash loop visible in /status: {workers_of(d)}, states seen {seen}\n{logs(d.state_dir)}"
            assert s["last_exit"].startswith("exited with status") and s["last_exit"] != "exited with status 0", s
            assert s["restarts"] >= 5

            # Backing off, not spinning: over the next 3 s the daemon starts at most a few workers.
            log = d.state_dir / "daemon.log"
            starts = log.read_text().count("worker 0 started")
            time.sleep(3)
            s = workers_of(d)[0]
            assert log.read_text().count("worker 0 started") - starts <= 3, logs(d.state_dir)
            assert s["consecutive_failures"] >= 5 and s["state"] in ("backoff", "starting"), s
            assert "crash loop" in log.read_text()

            # The daemon itself is unaffected.
            health = d.get("/health")
            assert health.status_code == 200, health.text
            status = d.status()
            assert status["state"] == "ready" and status["pid"] == d.pid
            cli = preload("status", "--state-dir", d.state_dir, "--json")
            assert cli.returncode == 0 and json.loads(cli.stdout)["workers"][0]["consecutive_failures"] >= 5
        finally:
            os.rename(hidden, fds_sock)

        # Once the cause is gone, the next attempt (at most MAX_BACKOFF later) succeeds.
        [w2] = wait_replaced(d, {0: w["pid"]}, timeout=REPLACE_TIMEOUT)
        complete(port)
        assert d.status()["fingerprint"] and d.get("/health").status_code == 200
        # A worker that made it to ready ended the streak: /status must not still report a crash loop.
        assert w2["consecutive_failures"] == 0, w2
