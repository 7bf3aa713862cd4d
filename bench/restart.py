"""Restart: from a worker's SIGKILL (or a `restart` request) to the first completion its
slot answers after it, against a cold start of the same daemon, at one or two model sizes.
A "worker" here is a slot's engine core: its front holds the client meanwhile, and hands
the request to the slot's next core (worker/front.py), so the answer comes from the new one.

Four kinds, `restarts` times each. Every daemon is started with an explicit
`--spare-workers` (its default differs between CPU and GPU), so that CPU and GPU runs
measure the same thing:
- sigkill: `--spare-workers 0`; the supervisor forks a new worker from its zygote;
- graceful: the same daemon, `restart` on the control socket (what `preload restart` sends);
- sigkill-spare: `--spare-workers 1`; before each kill /status shows the spare in
  standby (attached, warmed up, waiting), so each kill measures a warm spare taking the slot;
- sigkill-no-zygote: `--no-zygote --spare-workers 0`; the new worker is a fresh interpreter.

The clock: right after the event, one completion of one token on a fresh connection; its
answer is the end (`answered_s`). Between two restarts the bench waits until /status
shows the old worker reaped and the new one ready. Where a restart's time goes comes from
the stamps the daemon publishes for each slot's `last_replacement` (reaped, forked, slot
given, ready: wall clock of this machine) against the bench's own wall clock at the
event. Cold start: `preload start --workers 1` launched to exit 0 (every worker ready),
and to the API port's first /health 200. A worker's start stage by stage comes from
`bench/worker_start.py`, run in a fresh interpreter attached to the cold daemon.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path


from preload.bench.checkpoint import weight_bytes
from preload.bench.driver import Daemon, free_port, http_get, running_daemon, wait_for
from preload.bench.results import begin, finish, mib, quantiles, row, sec
from preload.ipc.client import DaemonClient

KINDS = ("sigkill-spare", "sigkill", "graceful", "sigkill-no-zygote")
DAEMON_FLAGS = {  # the daemon each kind runs on, beside --workers 1
    "sigkill": ("--spare-workers", 0),
    "graceful": ("--spare-workers", 0),
    "sigkill-spare": ("--spare-workers", 1),
    "sigkill-no-zygote": ("--spare-workers", 0, "--no-zygote"),
}
PROBE_TIMEOUT = 0.25  # seconds per /health probe
PROBE_INTERVAL = 0.01
RESTART_TIMEOUT = 120.0
BREAKDOWN_KEYS = ("old_reaped_s", "event_to_forked_s", "event_to_promoted_s", "forked_to_ready_s",
                  "promoted_to_ready_s", "go_to_ready_s", "ready_to_answer_s", "next_spare_standby_s")


# ---- a cold start ----------------------------------------------------------------------------


class FirstHealthy(threading.Thread):
    """Probes a port's /health from now on; `at` is when the first 200 came (perf_counter)."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.at, self.done = port, None, threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                if http_get(self.port, "/health", PROBE_TIMEOUT)[0] == 200:
                    self.at = time.perf_counter()
                    return
            except (OSError, http.client.HTTPException):
                pass
            self.done.wait(PROBE_INTERVAL)


@contextmanager
def timed_start(model: Path, device: str, kind: str):
    """A daemon with one worker, set up for `kind`: yields it and its cold start."""
    api_port = free_port()
    first = FirstHealthy(api_port)
    launched, t0 = time.time(), time.perf_counter()
    try:
        with running_daemon(model, "--device", device, "--workers", 1, *DAEMON_FLAGS[kind], api_port=api_port) as d:
            exit_s = time.perf_counter() - t0
            first.join(30)
            status = d.status()
            cold = {"exit_s": exit_s, "api_health_s": first.at and first.at - t0, "load_seconds": status["load_seconds"],
                    "breakdown": cold_breakdown(status, time.time(), launched)}
            yield d, cold
    finally:
        first.done.set()


def cold_breakdown(status: dict, read_at: float, launched: float) -> dict:
    """launch -> the daemon began (its imports), its load, -> the first worker forked
    (the zygote's imports, which overlap the load), -> that worker ready."""
    first = status["workers"][0]["last_replacement"] or {}
    if first.get("cause") != "start" or first.get("ready") is None:
        return {}
    began = read_at - status["uptime_s"]
    return {"daemon_imports_s": began - launched, "load_s": status["load_seconds"],
            "zygote_start_s": first["forked"] - began - status["load_seconds"],
            "worker_start_to_ready_s": first["ready"] - first["forked"]}


# ---- one restart -----------------------------------------------------------------------------


def first_answer(d: Daemon, t0: float) -> float:
    """Seconds from t0 to the answer of a one-token completion sent now (its front holds it
    until the slot has a core that computes it)."""
    conn = http.client.HTTPConnection("127.0.0.1", d.api_port, timeout=RESTART_TIMEOUT)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}),
                     {"content-type": "application/json"})
        response = conn.getresponse()
        t = time.perf_counter()
        body = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise RuntimeError(f"the completion after the restart failed: {response.status} {body[:500]!r}")
    return t - t0


def poll(d: Daemon, found, what: str, timeout: float = RESTART_TIMEOUT):
    """Read /status until `found(status)` returns something; return that."""
    value = wait_for(lambda: found(d.status()), timeout, interval=0.01)
    if value is None:
        raise TimeoutError(f"{what} within {timeout:.0f} s: {d.status()['workers']}\n{d.log_tail()}")
    return value


def settled(old: int):
    """Slot 0 once a new worker holds it, ready, and the daemon has reaped `old`."""

    def found(status: dict) -> dict | None:
        w = status["workers"][0]
        rep = w["last_replacement"] or {}
        reaped = rep.get("reaped") or rep.get("old_reaped")
        if w["pid"] not in (None, old) and w["state"] == "ready" and rep.get("new_pid") == w["pid"] \
                and rep.get("old_pid") == old and reaped and rep.get("ready"):
            return w
        return None

    return found


def standby_spare(not_pids: tuple[int, ...] = ()):
    def found(status: dict) -> dict | None:
        return next((s for s in status["spares"] if s["state"] == "standby" and s["pid"] not in not_pids), None)

    return found


def one_restart(d: Daemon, kind: str) -> dict:
    spare = poll(d, standby_spare(), "no spare in standby") if kind == "sigkill-spare" else None
    before = d.status()
    old = before["workers"][0]
    if kind == "graceful":
        with DaemonClient(d.state_dir, timeout=10) as client:
            event, t0 = time.time(), time.perf_counter()
            client.request("restart", now=False)
    else:
        event, t0 = time.time(), time.perf_counter()
        os.kill(old["pid"], signal.SIGKILL)
    seconds = first_answer(d, t0)
    now = poll(d, settled(old["pid"]), f"worker {old['pid']} did not settle")
    rep, new = now["last_replacement"], now["pid"]
    rec = {"kind": kind, "seconds": seconds, "old_pid": old["pid"], "new_pid": new,
           "old_gone_and_status_ready_s": time.perf_counter() - t0, "cause": rep["cause"], "via": rep["via"],
           "old_kv_cache_bytes": old["kv_cache_bytes"], "new_kv_cache_bytes": now["kv_cache_bytes"],
           "zygote_renewed": d.status()["zygote_restarts"] > before["zygote_restarts"],
           "breakdown": breakdown(rep, event, seconds)}
    if spare is not None:
        rec |= {"spare_pid": spare["pid"], "promoted": new == spare["pid"]}
        nxt = poll(d, standby_spare((old["pid"], new)), "no next spare in standby")
        rec["breakdown"]["next_spare_standby_s"] = nxt["warm"] - event
    return rec


def breakdown(rep: dict, event: float, seconds: float) -> dict:
    """Where one restart's time went, from a slot's last_replacement stamps: the event
    (wall clock) -> the daemon reaped the old worker; -> the new one forked, or a spare
    given the slot (promoted); -> ready; the rest, to the answer, is the front and the request."""
    def gap(t0: float | None, t1: float | None) -> float | None:
        return None if t0 is None or t1 is None else t1 - t0

    name, start = ("promoted", rep["slot_given"]) if rep["via"] == "spare" else ("forked", rep["forked"])
    out = {"old_reaped_s": gap(event, rep.get("reaped", rep.get("old_reaped"))),
           f"event_to_{name}_s": gap(event, start),
           f"{name}_to_ready_s": gap(start, rep["ready"]),
           "go_to_ready_s": gap(rep["slot_given"], rep["ready"]),
           "ready_to_answer_s": gap(gap(event, rep["ready"]), seconds)}
    if rep.get("old_signalled") is not None:  # a rolling restart: did the old worker drain before the new one took over?
        out["drained_first"] = rep["old_signalled"] < rep["slot_given"]
    return out


def worker_stages(d: Daemon) -> dict:
    """A worker's start stage by stage, in a fresh interpreter attached to `d`."""
    r = subprocess.run([sys.executable, "-m", "preload.bench.worker_start", str(d.state_dir)], capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- the whole benchmark ---------------------------------------------------------------------


def summarize(recs: list[dict], cold: dict) -> dict:
    q = quantiles(r["seconds"] for r in recs)
    api = cold["api_health_s"]["p50"] if cold["api_health_s"] else None
    out = {
        "runs": recs,
        "seconds": q,
        "ratio_p50_over_cold_exit": q["p50"] / cold["exit_s"]["p50"],
        "ratio_p50_over_cold_api_health": q["p50"] / api if api else None,
        "breakdown_median": {k: _median(r["breakdown"].get(k) for r in recs) for k in BREAKDOWN_KEYS},
        "kv_cache_changed": sum(r["new_kv_cache_bytes"] != r["old_kv_cache_bytes"] for r in recs),
        "zygote_renewed": sum(r["zygote_renewed"] for r in recs),
        "via_spare": sum(r["via"] == "spare" for r in recs),
    }
    if recs[0]["kind"] == "sigkill-spare":
        out["promoted"] = sum(r["promoted"] for r in recs)
    if recs[0]["kind"] == "graceful":
        out["drained_first"] = sum(bool(r["breakdown"].get("drained_first")) for r in recs)
    return out


def _median(values) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def bench_model(label: str, model: Path, restarts: int, cold_repeat: int, device: str, progress,
                kinds: tuple[str, ...] = KINDS) -> dict:
    res: dict = {"label": label, "path": str(model), "weight_bytes": weight_bytes(model), "phase_s": {}}
    runs: dict[str, list[dict]] = {}
    colds, status_errors = [], 0

    def series(d: Daemon, kind: str) -> None:
        t = time.perf_counter()
        for i in range(restarts):
            progress(f"{label}: {kind} restart {i + 1}/{restarts}")
            runs.setdefault(kind, []).append(one_restart(d, kind))
        res["phase_s"][kind] = round(time.perf_counter() - t, 3)  # to plan the next run

    for i in range(cold_repeat):
        progress(f"{label}: cold start {i + 1}/{cold_repeat}")
        with timed_start(model, device, "sigkill") as (d, cold):
            colds.append(cold)
            if i == cold_repeat - 1:  # the last one stays up for two kinds and the stages
                res["arena_bytes"] = int(sum(d.status()["bytes_per_device"].values()))
                for kind in ("sigkill", "graceful"):
                    if kind in kinds:
                        series(d, kind)
                progress(f"{label}: a worker's start, stage by stage, in a fresh interpreter")
                res["worker_stages"] = worker_stages(d)
            status_errors += d.status_errors
    res["cold"] = {"runs": colds, "exit_s": quantiles(c["exit_s"] for c in colds),
                   "api_health_s": quantiles(c["api_health_s"] for c in colds)}
    for kind, key in (("sigkill-spare", "cold_spare"), ("sigkill-no-zygote", "cold_no_zygote")):
        if kind not in kinds:
            continue
        progress(f"{label}: {' '.join(map(str, DAEMON_FLAGS[kind]))} daemon")
        with timed_start(model, device, kind) as (d, cold):
            res[key] = cold
            series(d, kind)
            status_errors += d.status_errors
    res["status_errors"] = status_errors
    res["restart"] = {kind: summarize(runs[kind], res["cold"]) for kind in KINDS if kind in kinds}
    return res


def run_restart(models: list[tuple[str, Path]], restarts: int = 10, cold_repeat: int = 3, device: str = "auto",
                progress=lambda msg: None, kinds: tuple[str, ...] = KINDS) -> dict:
    """`kinds`: of KINDS, those to run (the cold starts and a worker's stages are always measured)."""
    t0 = time.perf_counter()
    result = begin("restart", device) | {
        "restarts": restarts, "cold_repeat": cold_repeat, "kinds": [k for k in KINDS if k in kinds],
        "probe": {"timeout_s": PROBE_TIMEOUT, "interval_s": PROBE_INTERVAL}, "models": []}
    for label, model in models:
        result["models"].append(bench_model(label, Path(model).absolute(), restarts, cold_repeat, device, progress, kinds))
    return finish(result, t0)


# ---- the table -------------------------------------------------------------------------------


def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"preload bench restart: {result['restarts']} restarts of each kind, {result['cold_repeat']} cold starts,"
        f" {result['wall_s']:.0f} s in all",
        f"machine: {m['hostname']}, {m['cpus_usable']} CPUs ({m['cpu_model'] or '?'}), torch {m['torch']},"
        f" device {m['device_requested']}, load avg before {result['loadavg_before'][0]:.2f},"
        f" after {result['loadavg_after'][0]:.2f}",
        "",
    ]
    widths = (14, 11, 17, 7, 7, 7, 7, 10, 9, 0)
    lines.append(row(("model", "weights MiB", "kind", "p50 s", "p90 s", "min s", "max s", "/cold exit", "/cold API",
                      "checks"), widths))
    for r in result["models"]:
        c = r["cold"]
        lines.append(row((r["label"], mib(r["weight_bytes"]), "cold: start exit", *spread(c["exit_s"])), widths))
        if c["api_health_s"]:
            lines.append(row(("", "", "cold: API 200", *spread(c["api_health_s"])), widths))
        for key, name in (("cold_spare", "cold, 1 spare"), ("cold_no_zygote", "cold, no zygote")):
            if key in r:
                lines.append(row(("", "", name, sec(r[key]["exit_s"])), widths))
        for kind, k in r["restart"].items():
            n, api = k["seconds"]["n"], k["ratio_p50_over_cold_api_health"]
            lines.append(row(("", "", kind, *spread(k["seconds"]),
                              f"{k['ratio_p50_over_cold_exit']:.3f}", "-" if api is None else f"{api:.3f}",
                              checks(k, n)), widths))
    lines += ["", "where a restart's time goes (medians, seconds; from the daemon's /status stamps;"
                  " start = forked, or given the slot for a spare):"]
    widths = (14, 17, 7, 7, 11, 9, 12, 10, 10)
    lines.append(row(("model", "kind", "p50", "p90", "old reaped", "->start", "start->ready", "ready->answer",
                      "next spare"), widths))
    for r in result["models"]:
        for kind, k in r["restart"].items():
            b = k["breakdown_median"]
            spare = kind == "sigkill-spare"
            answer = b.get("ready_to_answer_s", b.get("ready_to_200_s"))  # (runs before fronts: to a /health 200)
            lines.append(row((r["label"], kind, sec(k["seconds"]["p50"]), sec(k["seconds"]["p90"]),
                              sec(b["old_reaped_s"]), sec(b["event_to_promoted_s" if spare else "event_to_forked_s"]),
                              sec(b["promoted_to_ready_s" if spare else "forked_to_ready_s"]), sec(answer),
                              sec(b["next_spare_standby_s"])), widths))
    lines += ["", "a worker's start, stage by stage, in a fresh interpreter attached to the daemon (seconds):"]
    stages = ("imports_s", "cuda_context_s", "attach_s", "llm_total_s", "model_views_s", "engine_kv_cache_s",
              "first_token_s", "second_token_s")
    widths = (14, 8, 8, 7, 7, 7, 9, 9, 9)
    lines.append(row(("model", "imports", "context", "attach", "LLM()", "views", "KV cache", "1st token", "2nd token"),
                     widths))
    for r in result["models"]:
        st = r["worker_stages"]
        if "error" in st:
            lines.append(f"{r['label']}: {(st['error'].strip().splitlines() or ['failed'])[-1]}")
        else:
            lines.append(row((r["label"], *(sec(st.get(s)) for s in stages)), widths))
    lines += ["", "cold start, where it goes (median run; seconds): daemon imports, load, zygote start after the load,"
                  " worker fork->ready"]
    for r in result["models"]:
        bs = [c["breakdown"] for c in r["cold"]["runs"] if c["breakdown"]]
        if bs:
            lines.append(f"  {r['label']}: " + ", ".join(f"{k.removesuffix('_s')} {statistics.median(b[k] for b in bs):.3f}"
                                                         for k in bs[0]))
    errors = {r["label"]: r["status_errors"] for r in result["models"] if r["status_errors"]}
    if errors:
        lines += ["", f"the daemon's /status answered other than 200 (retried) this many times: {errors}"]
    return "\n".join(lines)


def spread(q: dict) -> tuple[str, ...]:
    return sec(q["p50"]), sec(q["p90"]), sec(q["min"]), sec(q["max"])


def checks(k: dict, n: int) -> str:
    """What must hold for a kind's figures to mean what they say, where it did not always."""
    out = []
    if "promoted" in k:
        out.append(f"spare promoted {k['promoted']}/{n}")
    if "drained_first" in k:
        out.append(f"old drained first {k['drained_first']}/{n}")
    if k["zygote_renewed"]:
        out.append(f"zygote renewed (code changed) {k['zygote_renewed']}/{n}")
    if k["kv_cache_changed"]:
        out.append(f"KV cache size changed {k['kv_cache_changed']}/{n}")
    return "; ".join(out)
