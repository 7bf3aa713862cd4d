"""Sleep and wake: how fast a daemon lets the device go and serves again, what it frees,
and whether cycles leave anything behind (issue 37's figures).

One daemon, `--workers 1 --spare-workers S`, started cold (that start's time is the
figure a level-2 wake compares with). Then, for each level, `cycles` times: the daemon
asked to sleep on its control socket (what `preload sleep` sends), timed until /status
says asleep; the device's used memory then (nvidia-smi, from this process, which never
touches CUDA: bench/gpu.py), against what the daemon held before; the daemon asked to
wake, with one streamed completion sent at that moment (it waits in the front, as a
client's would): timed to /status ready, and to that completion's first token ("wake to
serving").
Every answer is the greedy completion of one fixed prompt, compared with the one before
the first sleep. After each cycle, with the spares back in standby: the daemon's
processes, their open fds and private memory, and the device's used memory: a leak
shows as growth over the second half of the cycles (the first ones warm heaps up).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx

from preload.bench.checkpoint import weight_bytes
from preload.bench.driver import daemon_processes, free_port, start_daemon, stop_everything
from preload.bench.gpu import Gpu
from preload.bench.results import begin, finish, quantiles, row, sec
from preload.ipc.client import DaemonClient

PROMPT = "The quick brown fox"
TOKENS = 16
STEP_TIMEOUT = 300.0  # seconds a sleep, a wake or a spare's standby may take before the bench gives up


def complete(api_port: int, first=lambda: None) -> str:
    """The greedy completion of PROMPT, streamed (it waits while the daemon sleeps or
    wakes); `first()` is called when its first token arrives."""
    text = []
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{api_port}/v1/completions", json=body, timeout=STEP_TIMEOUT) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if not text:
                    first()
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def footprint(state_dir: Path, gpu: Gpu | None) -> dict:
    """The daemon's processes, their fds and private resident memory (resident less the
    pages shared with a file or another process: the weights a core has touched count in
    its resident size, not as a leak), the device's used memory."""
    procs, fds, private = 0, 0, 0
    for p in daemon_processes(state_dir):
        try:
            m = p.memory_info()
            fds, private, procs = fds + p.num_fds(), private + m.rss - m.shared, procs + 1
        except Exception:  # noqa: BLE001 (gone meanwhile: not counted)
            continue
    return {"processes": procs, "fds": fds, "private_bytes": private,
            "device_used_mib": gpu.used_mib() if gpu else None}


def settled_footprint(state_dir: Path, gpu: Gpu | None, most: float = 2.0) -> dict:
    """`footprint` once its processes and fds read the same twice 0.1 s apart (up to `most`
    seconds): on a busy machine a single count now and then held one or two fds more than
    the counts before and after it (a socket or pipe of the cycle just done, not yet
    closed), which a leak keeps and a settled count does not."""
    last, until = footprint(state_dir, gpu), time.monotonic() + most
    while time.monotonic() < until:
        time.sleep(0.1)
        now = footprint(state_dir, gpu)
        if (now["processes"], now["fds"]) == (last["processes"], last["fds"]):
            return now
        last = now
    return last


def asleep_split(apps: dict[int, int | None], spares: set[int]) -> dict:
    """Who holds the device while asleep, from nvidia-smi's processes: the kept spares and
    the others (the daemon's own context), in MiB."""
    held = {pid: mib or 0 for pid, mib in apps.items()}
    return {"spares": sum(m for pid, m in held.items() if pid in spares),
            "others": sum(m for pid, m in held.items() if pid not in spares)}


def ask(state_dir: Path, until, **request) -> tuple[float, dict]:
    """Send `request` on the control socket; (seconds until `until(status)`, that status)."""
    with DaemonClient(state_dir, timeout=10) as client:
        t = time.perf_counter()
        reply = client.request(**request)
        if reply.get("ok") is False:
            raise RuntimeError(f"{request}: {reply.get('error')}")
        s = polled(client, until, t, str(request))
        return time.perf_counter() - t, s


def standby(state_dir: Path, spares: int) -> float:
    """Seconds until every spare stands by (0 when there are none)."""
    with DaemonClient(state_dir, timeout=10) as client:
        t = time.perf_counter()
        polled(client, lambda s: [w["state"] for w in s["spares"]] == ["standby"] * spares, t, "the spares' standby")
        return time.perf_counter() - t


def polled(client: DaemonClient, until, since: float, what: str) -> dict:
    """The daemon's status once `until(status)`; TimeoutError STEP_TIMEOUT after `since`."""
    while not until(s := client.request("status")["status"]):
        if time.perf_counter() - since > STEP_TIMEOUT:
            raise TimeoutError(f"{what}: not done within {STEP_TIMEOUT:.0f} s (state {s['state']})")
        time.sleep(0.005)
    return s


def cycle(state_dir: Path, api_port: int, level: int, spares: int, gpu: Gpu | None) -> dict:
    """One sleep and wake at `level`: its times, what the sleep freed, the answer after."""
    asleep_s, s = ask(state_dir, lambda s: (s.get("sleep") or {}).get("asleep"), op="sleep", level=level)
    if s["sleep"].get("error"):
        raise RuntimeError(f"sleep level {level}: {s['sleep']['error']}")
    out = {"level": level, "sleep_s": asleep_s, "host_bytes": s["sleep"]["host_bytes"],
           "spares_kept": s["sleep"].get("spares_kept", 0)}  # (through the sleep: preloadd/sleeping.py)
    if gpu is not None:
        out["asleep_used_mib"] = gpu.used_mib()
        out["asleep_mib"] = asleep_split(gpu.apps(), {w["pid"] for w in s.get("spares", [])})
    answered: dict = {}

    def client() -> None:
        try:
            answered["text"] = complete(api_port, lambda: answered.setdefault("at", time.perf_counter() - t))
        except httpx.HTTPError as e:
            answered["error"] = repr(e)
    asker = threading.Thread(target=client, daemon=True)
    t = time.perf_counter()
    asker.start()
    out["wake_ready_s"], _ = ask(state_dir, lambda s: s["state"] == "ready", op="wake")
    asker.join(STEP_TIMEOUT)
    out["wake_serving_s"] = answered.get("at")
    out["text"], out["error"] = answered.get("text"), answered.get("error")
    out["spares_standby_s"] = standby(state_dir, spares)
    return out | {"after": settled_footprint(state_dir, gpu)}


def run_sleep(model: Path, device: str, levels: list[int], cycles: int, spares: int, progress=lambda m: None) -> dict:
    t0 = time.perf_counter()
    gpu = Gpu.for_device(device)
    result = begin("sleep", device, gpu) | {"model": str(model), "weight_bytes": weight_bytes(model), "levels": levels,
                                            "cycles": cycles, "spare_workers": spares, "runs": []}
    work = Path(tempfile.mkdtemp(prefix="preload-sleep-"))
    state_dir, api_port = work / "state", free_port()
    try:
        baseline = gpu.used_mib() if gpu else None
        progress("cold start")
        t = time.perf_counter()
        start_daemon(state_dir, model, "--device", device, "--workers", 1, "--spare-workers", spares, api_port=api_port)
        result["cold_start_s"] = time.perf_counter() - t
        result["spares_standby_s"] = standby(state_dir, spares)
        reference = complete(api_port)
        result["before"] = settled_footprint(state_dir, gpu)
        held = result["before"]["device_used_mib"] - baseline if gpu else None
        result["device_baseline_mib"], result["device_held_mib"] = baseline, held
        for level in levels:
            for i in range(cycles):
                progress(f"level {level}: sleep and wake {i + 1}/{cycles}")
                c = cycle(state_dir, api_port, level, spares, gpu)
                c["same_output"] = c["text"] == reference
                if gpu is not None:
                    c["freed_share"] = (result["before"]["device_used_mib"] - c["asleep_used_mib"]) / held
                result["runs"].append(c)
    finally:
        stop_everything(state_dir)
        shutil.rmtree(work, ignore_errors=True)
    result["levels_summary"] = {str(level): summary([r for r in result["runs"] if r["level"] == level])
                                for level in levels}
    return finish(result, t0)


def summary(runs: list[dict]) -> dict:
    # A leak grows with the cycles; the first few warm things up (a front's heap grew 50 MiB
    # over 8 cycles on v2-lite-mini, then nothing over 12 more): the second half counts.
    first, last = runs[len(runs) // 2]["after"], runs[-1]["after"]
    return {
        "sleep_s": quantiles(r["sleep_s"] for r in runs),
        "wake_ready_s": quantiles(r["wake_ready_s"] for r in runs),
        "wake_serving_s": quantiles(r["wake_serving_s"] for r in runs),
        "spares_standby_s": quantiles(r["spares_standby_s"] for r in runs),
        "same_output": sum(r["same_output"] for r in runs),
        "spares_kept": sum(r["spares_kept"] for r in runs),
        "errors": [r["error"] for r in runs if r["error"]],
        "freed_share_min": min((r["freed_share"] for r in runs if "freed_share" in r), default=None),
        "asleep_mib_max": {k: max(r["asleep_mib"][k] for r in runs) for k in ("spares", "others")}
        if all("asleep_mib" in r for r in runs) else None,
        "growth": {k: last[k] - first[k] for k in first if first[k] is not None and last[k] is not None},
    }


def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [f"preload bench sleep: {result['model']} ({result['weight_bytes'] / 2**30:.2f} GiB), --workers 1"
             f" --spare-workers {result['spare_workers']}, {result['cycles']} cycles a level, on"
             f" {m.get('cuda_device') or m.get('cpu_model')}; {result['wall_s']:.0f} s",
             f"cold start (`preload start` to exit 0) {sec(result['cold_start_s'])} s"
             + (f"; the daemon held {result['device_held_mib']} MiB of the device" if result["device_held_mib"] else ""),
             ""]
    widths = (6, 12, 14, 16, 12, 12, 10, 8, 12)
    lines.append(row(("level", "sleep p50", "wake to ready", "wake to serving", "(max)", "freed (min)", "same out",
                      "kept", "spare back"), widths))
    for level, s in result["levels_summary"].items():
        freed = f"{100 * s['freed_share_min']:.1f}%" if s["freed_share_min"] is not None else "-"
        n = sum(r["level"] == int(level) for r in result["runs"])
        lines.append(row((level, sec(s["sleep_s"]["p50"]), sec(s["wake_ready_s"]["p50"]), sec(s["wake_serving_s"]["p50"]),
                          sec(s["wake_serving_s"]["max"]), freed, f"{s['same_output']}/{n}", s["spares_kept"],
                          sec(s["spares_standby_s"]["p50"])), widths))
    lines.append("")
    for level, s in result["levels_summary"].items():
        g = s["growth"]
        lines.append(f"level {level}, over the second half of the cycles: processes {g.get('processes', 0):+d}, fds {g.get('fds', 0):+d},"
                     f" private memory {g.get('private_bytes', 0) / 2**20:+.1f} MiB"
                     + (f", device {g['device_used_mib']:+d} MiB" if "device_used_mib" in g else "")
                     + (f"; errors: {s['errors'][:2]}" if s["errors"] else ""))
        if s.get("asleep_mib_max"):
            lines.append(f"level {level}, asleep: the kept spares held {s['asleep_mib_max']['spares']} MiB of the device"
                         f" at most, the other processes (the daemon's context) {s['asleep_mib_max']['others']} MiB")
    lines += ["", "wake to serving: the wake asked, with a streamed completion sent at that moment, to its first"
              " token; freed: of the device memory the daemon held, at sleep; kept: spares kept through the sleeps"
              " (level 1 on a GPU: on the device, their weights let go; the slot's core after the wake); spare back:"
              " p50 from that answer to every spare standing by again"]
    return "\n".join(lines)
