"""Helpers for tests of supervised workers (`preload start --workers N`): start
arguments, /status polling, completions on the daemon's API port, process lookups."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import psutil
from daemons import wait_for

PROMPT = "t5 t6 t7"
REPLACE_TIMEOUT = 60.0  # seconds for a replacement worker to be ready; ~1 s on an idle machine
ZYGOTE_TITLE = "preload zygote"  # its process title (setproctitle)


def start_args(api_port: int, workers: int = 1, *extra) -> tuple:
    return ("--workers", workers, "--port", api_port, "--dtype", "float32", *extra)


def api(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def workers_of(d) -> list[dict]:
    return d.status()["workers"]


def ready_workers(d) -> list[dict] | None:
    """The workers once every slot has a ready one, else None."""
    ws = workers_of(d)
    return ws if all(w["state"] == "ready" and w["pid"] for w in ws) else None


def wait_replaced(d, old_pids: dict[int, int], timeout: float = REPLACE_TIMEOUT) -> list[dict]:
    """Wait until every slot in `old_pids` (slot -> pid) has a different pid, ready."""

    def replaced():
        ws = workers_of(d)
        by_slot = {w["slot"]: w for w in ws}
        done = all(by_slot[s]["pid"] not in (None, p) and by_slot[s]["state"] == "ready" for s, p in old_pids.items())
        return ws if done else None

    ws = wait_for(replaced, timeout=timeout, interval=0.02)
    assert ws, f"workers not replaced within {timeout} s: {workers_of(d)}\n{logs(d.state_dir)}"
    return ws


def logs(state_dir: Path, tail: int = 3000) -> str:
    out = []
    for path in sorted(state_dir.glob("*.log")):
        try:
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        except OSError:
            pass
    return "\n".join(out)


def complete(port: int, client: httpx.Client | None = None, max_tokens: int = 8, timeout: float = 60.0) -> dict:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if client is None:
        with httpx.Client(timeout=timeout) as fresh:
            r = fresh.post(api(port) + "/v1/completions", json=body)
    else:
        r = client.post(api(port) + "/v1/completions", json=body)
    assert r.status_code == 200, f"{r.status_code}: {r.text}"
    out = r.json()
    assert out["usage"]["completion_tokens"] == max_tokens, out
    return out


KEEPER_TITLE = "preload keeper"  # the daemon's keeper (tests/preloadd/test_keeper.py), no worker of it


GREEDY_PROMPTS = ([5, 6, 7, 8], [30, 2, 41, 9, 17, 17], [90] * 12)


def greedy(port: int, prompts=GREEDY_PROMPTS) -> list[str]:
    """Each prompt's 16 greedy tokens (as text) from the API on `port`."""
    out = []
    for prompt in prompts:
        r = httpx.post(api(port) + "/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                             "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def slot_pids(d) -> list[int]:
    """The pids /status shows serving: each slot's engine core (its worker) and its front."""
    return sorted(p for w in workers_of(d) for p in (w["pid"], w["front"]["pid"]) if p)


def children(pid: int) -> list[psutil.Process]:
    """Live (not zombie) direct children of the daemon `pid`: its zygote, workers and fronts."""
    out = []
    for c in psutil.Process(pid).children():
        try:
            if c.status() != psutil.STATUS_ZOMBIE and not " ".join(c.cmdline()).startswith(KEEPER_TITLE):
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


def zombies(pid: int) -> list[int]:
    out = []
    for c in psutil.Process(pid).children():
        try:
            if c.status() == psutil.STATUS_ZOMBIE:
                out.append(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def zygotes(d) -> list[psutil.Process]:
    """The daemon's zygote(s): its children running the zygote module that are not workers
    (workers are forked from the zygote, so their command line is the zygote's)."""
    worker_pids = {w["pid"] for w in workers_of(d)}
    out = []
    for c in children(d.pid):
        try:
            if " ".join(c.cmdline()).startswith(ZYGOTE_TITLE) and c.pid not in worker_pids:
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


def processes_naming(state_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line mentions this state dir anywhere (the daemon
    names it in a flag, the zygote and its workers in their JSON spec)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if any(str(state_dir) in a for a in proc.info["cmdline"] or []):
            found.append(proc)
    return found


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_daemon(d) -> None:
    os.kill(d.pid, signal.SIGKILL)
    assert wait_for(lambda: dead(d.pid), timeout=10)
