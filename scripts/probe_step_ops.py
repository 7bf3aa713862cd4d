"""How many torch operations an engine step dispatches on the host, with drafts launched
ahead (--drafts-ahead) and one step at a time: on the CPU, the bundled model, its CUDA graphs
stood in for (tests/graphs_on_cpu.py) and their replays skipped, so that what is counted is
the host's own work around them (every operation costs a dispatch, and on a GPU a launch: a
few microseconds each), and the small copies of host values to the device among them (on a
GPU each is also a page-locked staging copy: host_values.to_device). A probe, not product.

    python3 scripts/probe_step_ops.py > ops.json
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # (the stand-ins for the graphs)

import graphs_on_cpu  # noqa: E402
from engine_steps import speculating  # noqa: E402

from preload import BUNDLED_MODEL, LLM  # noqa: E402
from preload.options import EngineOptions  # noqa: E402
from preload.worker.engine.pipeline import StepPipeline  # noqa: E402
from preload.worker.engine.sampling_params import SamplingParams  # noqa: E402
from preload.worker.engine.sequence import Sequence  # noqa: E402
from preload.worker.model import host_values  # noqa: E402

STEPS = 10  # counted, after 8 that fill the drafts and capture the buckets


class Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class Patches:
    """monkeypatch's setattr and undo, for graphs_on_cpu.stand_in_for_graphs outside pytest."""

    def __init__(self):
        self.saved = []

    def setattr(self, target, name, value):
        self.saved.append((target, name, getattr(target, name)))
        setattr(target, name, value)

    def undo(self):
        for target, name, value in reversed(self.saved):
            setattr(target, name, value)
        self.saved.clear()


def count(llm: LLM, config: EngineOptions, batch: int) -> dict:
    patches = Patches()
    graphs_on_cpu.stand_in_for_graphs(patches)
    try:
        engine = graphs_on_cpu.engine_with_graphs(llm, config)
        patches.setattr(graphs_on_cpu.EagerGraph, "replay", lambda self: None)  # (the host's work alone)
        engine.pipeline = StepPipeline(engine)
        for i in range(batch):
            engine.add(Sequence([5 + i, 6, 7, 8], SamplingParams(max_tokens=STEPS * 10, ignore_eos=True)))
        for _ in range(8):
            engine.step()
        counting, copies = Counting(), [0]
        copying = host_values.to_device

        def counted(host, device):
            copies[0] += 1
            return copying(host, device)

        for module in [m for name, m in sys.modules.items() if name.startswith("preload.")]:
            if getattr(module, "to_device", None) is copying:  # (every module's name for it)
                patches.setattr(module, "to_device", counted)
        with counting:
            for _ in range(STEPS):
                engine.step()
        top = sorted(counting.ops.items(), key=lambda item: -item[1])[:10]
        return {"ops_per_step": sum(counting.ops.values()) / STEPS, "copies_per_step": copies[0] / STEPS,
                "top": {k: v / STEPS for k, v in top}}
    finally:
        patches.undo()


def main() -> dict:
    llm = LLM(BUNDLED_MODEL, dtype="float32", engine=EngineOptions(kv_cache_memory=64 << 20))
    base = EngineOptions(kv_cache_memory=64 << 20, enable_prefix_caching=False, max_num_seqs=16)
    out = {}
    for method in ("mtp", "draft_model"):
        for k in (1, 3):
            for batch in (1, 16):
                for ahead in (False, True):
                    label = f"{method} k={k} batch={batch} {'ahead' if ahead else 'one at a time'}"
                    out[label] = count(llm, speculating(replace(base, drafts_ahead=ahead), method, k), batch)
                    print(f"{label}: {out[label]['ops_per_step']:.0f} ops, {out[label]['copies_per_step']:.1f} "
                          "copies to the device a step", file=sys.stderr)
    return out


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=1)
