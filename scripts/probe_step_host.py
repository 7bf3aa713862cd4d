"""Where a replayed prompt step's host time goes: `preload bench prefill`'s step (random
V2-Lite weights on the GPU, prompt graphs on), run under torch's profiler with the CPU's
activity, the ops ranked by their own CPU time, the CUDA runtime calls counted (syncs
and copies among them), and the step's wall time against the GPU's busy time.
A probe, not product.

    python3 scripts/probe_step_host.py 1024x4 2048x8 > host.json
"""

import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from preload.bench.prefill import Case, Step, prefill_engine, sync


def main(labels: list[str]) -> dict:
    dev = torch.device("cuda")
    cases = [Case.parse(c) for c in labels]
    engine, cfg = prefill_engine(None, "v2-lite", "none", dev, cases, [], 2048, graphs=True)
    out = {}
    for case in cases:
        step = Step(engine, case, cfg.vocab_size, seed=1)
        for _ in range(3):
            sync(dev)
            step.run()
        walls = []
        for _ in range(5):
            sync(dev)
            t = time.perf_counter()
            step.run()
            walls.append(time.perf_counter() - t)
        sync(dev)
        # host time alone: how long run() takes to return when the GPU has work queued ahead
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step.run()
            sync(dev)
        events = prof.key_averages()
        cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]
        runtime = {e.key: (e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in events
                   if e.key.startswith("cuda") or "Memcpy" in e.key or "Synchronize" in e.key}
        busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
        out[case.label] = {"wall_ms": sorted(walls)[2] * 1e3, "gpu_busy_ms_profiled": busy,
                           "top_cpu": [(e.key[:80], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in cpu],
                           "runtime": runtime}
        print(case.label, json.dumps(out[case.label], indent=0)[:6000], file=sys.stderr)
        step.release()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
