"""Where a step's wall time goes that its kernels do not fill, on the GPU's own timeline:
from the host's call to the first kernel (the host preparing the step), the union of the
device's work (kernels, copies, sets: "busy"), the idle gaps between them (the largest
named by the kernels on either side), and from the last one's end to the call's return
(the tokens' copy to the host, the sampling's bookkeeping). A step replayed from CUDA
graphs makes few model calls for step_profile.py's events to time, so this reads the
profiler's trace itself: each run of the step in a record_function range, and every
activity on the device with its start and end on the same clock as the host's.

On the H200, a 2,048-token fp8_block step took 25.2 ms where its kernels took 22.6: whether
the 2.6 ms are the host's (before the first kernel, or launches the GPU waits for) or
bubbles between kernels decides what to fix; this says which.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

RANGE = "preload bench: one step"
GAPS = 6  # the largest gaps reported


def timeline(call: tuple[float, float], device: list[tuple[float, float, str]], gaps: int = GAPS) -> dict:
    """The parts of one call's wall time [start, end] (us), from the device's activities
    (start, end, name; us, the same clock) that began within it, in ms."""
    start, end = call
    work = sorted(a for a in device if start <= a[0] <= end)
    if not work:
        return {"wall_ms": (end - start) / 1e3, "to_first_ms": None, "busy_ms": 0.0, "idle_ms": None,
                "after_last_ms": None, "activities": 0, "gaps": []}
    busy, idle, found = 0.0, 0.0, []
    run_start, run_end, last_name = work[0][0], work[0][1], work[0][2]
    for a_start, a_end, name in work[1:]:
        if a_start > run_end:  # a gap: the device had nothing to do
            idle += a_start - run_end
            found.append((a_start - run_end, run_end, last_name, name))
            busy += run_end - run_start
            run_start, run_end = a_start, a_end
        else:
            run_end = max(run_end, a_end)
        if a_end >= run_end:
            last_name = name
    busy += run_end - run_start
    found.sort(key=lambda g: -g[0])
    return {"wall_ms": (end - start) / 1e3, "to_first_ms": (work[0][0] - start) / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": idle / 1e3, "after_last_ms": max(end - run_end, 0.0) / 1e3, "activities": len(work),
            "gaps": [{"us": g, "at_ms": (at - start) / 1e3, "after": before[:80], "before": after[:80]}
                     for g, at, before, after in found[:gaps]]}


def step_timeline(step: Callable[[], None], times: int) -> dict:
    """`timeline` of the median (by wall time) of `times` runs of `step` under the profiler,
    each run synchronized before and after; with every run's wall time."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(times):
            torch.cuda.synchronize()
            with record_function(RANGE):
                step()
                torch.cuda.synchronize()
    events = prof.events()
    calls = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name == RANGE and e.device_type == torch.autograd.DeviceType.CPU)
    device = [(e.time_range.start, e.time_range.end, e.name) for e in events
              if e.device_type == torch.autograd.DeviceType.CUDA and e.name != RANGE]
    runs = sorted((timeline(c, device) for c in calls), key=lambda t: t["wall_ms"])
    return runs[len(runs) // 2] | {"runs_wall_ms": [t["wall_ms"] for t in runs]}


def describe(t: dict) -> str:
    """One line of a timeline, then its largest gaps."""
    if t.get("to_first_ms") is None:
        return f"{t['wall_ms']:.2f} ms, no device activity seen"
    text = (f"{t['wall_ms']:.2f} ms: {t['to_first_ms']:.2f} to its first kernel, {t['busy_ms']:.2f} busy,"
            f" {t['idle_ms']:.2f} idle between ({t['activities']} activities), {t['after_last_ms']:.2f} after the last")
    return "\n".join([text] + [f"    gap {g['us']:7.1f} us at {g['at_ms']:6.2f} ms: after {g['after']}, before {g['before']}"
                               for g in t["gaps"]])
