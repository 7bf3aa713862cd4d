"""What a Triton launch costs the host (kernels/launch.py): `preload bench prefill`'s step
(random V2-Lite weights on the GPU, prompt graphs on), whose attention between the
replayed pieces is launched eagerly; its host time a step, the time of each kernel's
launches there (through the JIT or kernels/launch.py, as the tree launches them), and each
of those launches repeated alone: through the JIT
(`kernel[grid]`), through kernels/launch.py (`launcher(kernel)[grid]`, the kind of call
looked up), and through the compiled kernel's launcher alone (the floor); a few torch ops
for scale. A probe, not product.

    python3 scripts/probe_launch.py none 512x4+64@1024 > launch.json
"""

import json
import sys
import time
from collections import defaultdict

import torch
from triton.runtime.jit import JITFunction

from preload.bench.prefill import Case, Step, prefill_engine, sync
from preload.kernels.launch import Launcher, launcher


def per_call(fn, dev, times: int = 200) -> float:
    """Host microseconds a call, `times` calls queued back to back."""
    sync(dev)
    t = time.perf_counter()
    for _ in range(times):
        fn()
    spent = (time.perf_counter() - t) / times
    sync(dev)
    return spent * 1e6


def main(quant: str, label: str) -> dict:
    dev = torch.device("cuda")
    case = Case.parse(label)
    engine, cfg = prefill_engine(None, "v2-lite", quant, dev, [case], [], 4096, graphs=True)
    step = Step(engine, case, cfg.vocab_size, seed=1)
    for _ in range(3):  # (captures, compiles)
        step.run()
    spent, calls, first = defaultdict(float), defaultdict(int), {}
    jit_run, kept_launch = JITFunction.run, Launcher.launch
    inside = []  # (a launcher's first call of a kind runs the JIT: timed once, as the launcher's)

    def timed(name: str, kernel, args, grid, keywords, call):
        t = time.perf_counter()
        try:
            return call()
        finally:
            spent[name] += time.perf_counter() - t
            calls[name] += 1
            first.setdefault(kernel.fn.__name__, (kernel, args, grid, keywords))

    def timed_run(self, *args, grid, warmup, **kwargs):
        call = lambda: jit_run(self, *args, grid=grid, warmup=warmup, **kwargs)  # noqa: E731
        return call() if inside else timed(f"{self.fn.__name__} (JIT)", self, args, grid, kwargs, call)

    def timed_launch(self, grid, args, keywords):
        inside.append(self)
        try:
            return timed(f"{self.kernel.fn.__name__} (launcher)", self.kernel, args, grid, keywords,
                         lambda: kept_launch(self, grid, args, keywords))
        finally:
            inside.pop()

    steps = 10
    JITFunction.run, Launcher.launch = timed_run, timed_launch
    try:
        sync(dev)
        t = time.perf_counter()
        for _ in range(steps):
            step.launch()
        host = (time.perf_counter() - t) / steps
        sync(dev)
    finally:
        JITFunction.run, Launcher.launch = jit_run, kept_launch
    out = {"case": case.label, "quant": quant, "device": torch.cuda.get_device_name(), "host_ms_a_step": host * 1e3,
           "in_the_step": {k: {"launches_a_step": calls[k] / steps, "us": spent[k] / calls[k] * 1e6} for k in spent},
           "alone_us": {}}
    for name, (kernel, args, grid, kwargs) in first.items():  # (kernels launched through the JIT in the step)
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        compiled = kernel[grid](*args, **kwargs)
        values = [*args, *(kwargs[n] for n in kernel.arg_names[len(args):])]
        run = compiled[grid3]
        out["alone_us"][name] = {"jit": per_call(lambda: kernel[grid](*args, **kwargs), dev),
                                 "launcher": per_call(lambda: launcher(kernel)[grid](*args, **kwargs), dev),
                                 "compiled": per_call(lambda: run(*values), dev)}
    x = torch.randn(64, 16, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 512, device=dev, dtype=torch.bfloat16)
    rows = torch.arange(0, 4096, 3, device=dev)
    table = torch.randn(8192, 512, device=dev, dtype=torch.bfloat16)
    out["torch_us"] = {"empty": per_call(lambda: torch.empty(64, 16, 512, device=dev), dev),
                       "index": per_call(lambda: table[rows], dev),
                       "linear": per_call(lambda: torch.nn.functional.linear(x[:, 0], w), dev),
                       "copy_": per_call(lambda: x[:32].copy_(x[32:]), dev)}
    return out


if __name__ == "__main__":
    json.dump(main(*sys.argv[1:3]), sys.stdout, indent=1)
    print()
