"""CUDA graphs stood in for on the CPU, so that an engine's replayed steps run in CI.

A "capture" keeps the step's function and the outputs of its one run; a "replay" runs it
again, eagerly, and copies what it returns into those outputs, as a replay overwrites a
graph's static outputs. Everything around the graphs runs as it does on a GPU: the host
buffers filled and copied in (cuda_graphs.DecodeGraphs._fill), rows moved on the device
(shift_rows), buckets, padding rows on the scratch block, the drafter's graphs, the
prompt steps' pieces between attentions (prompt_graphs.py). What it cannot show is the
GPU's part: a kernel that reads something a capture froze (a host value, a pointer) is
seen only by the GPU tests (tests/gpu/).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from preload.worker.engine import cuda_graphs, prompt_graphs
from preload.worker.engine.engine import Engine
from preload.worker.engine.speculative import SpecConfig
from preload.worker.llm import LLM


@dataclass
class EagerGraph:
    """A captured step, replayed by running it again: `replays` counts the replays."""

    run: object
    out: object  # what the captured run returned: a tensor, a tuple of them, or None
    replays: int = 0

    def replay(self) -> None:
        self.replays += 1
        new = self.run()
        for mine, theirs in zip(*((x if isinstance(x, tuple) else (x,)) for x in (self.out, new))):
            if mine is not None and mine is not theirs:  # (the log-probs are written in place, as in a graph)
                mine.copy_(theirs)

    def pool(self) -> None:
        return None


class HostEvent:
    """torch.cuda.Event where every copy is done when made."""

    def record(self, *_) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def frozen(run):
    """`run` with the variables it closes over fixed at their values now, as a capture fixes
    what the graph does (prompt_graphs.py captures each piece in a loop, `i` changing after)."""
    cells = tuple(types.CellType(cell.cell_contents) for cell in run.__closure__ or ())
    return types.FunctionType(run.__code__, run.__globals__, run.__name__, run.__defaults__, cells)


def stand_in_for_graphs(monkeypatch) -> list[EagerGraph]:
    """Patch CUDA's graphs, pinned memory and events for the CPU; every graph "captured"
    from now on, in order of capture."""
    made: list[EagerGraph] = []

    def captured(run, pool):
        run = frozen(run)
        graph = EagerGraph(run, run())
        made.append(graph)
        return graph, graph.out

    for module in (cuda_graphs, prompt_graphs):
        monkeypatch.setattr(module, "captured", captured)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self)
    monkeypatch.setattr(torch.cuda, "Event", HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **kw: None)
    return made


def engine_with_graphs(llm: LLM, config) -> Engine:
    """An engine of `llm`'s model for EngineOptions `config`, its decode (and the drafter's)
    steps captured as LLM.start_engine captures them on a GPU, and without a drafter its
    prompt steps' pieces at their first use (stand_in_for_graphs first)."""
    spec = SpecConfig.parse(config.speculative_config)
    draft = llm._draft_model(config)
    graphs, draft_graphs = llm._decode_graphs(config, spec, draft)
    prompts = prompt_graphs.PromptGraphs(llm.model, config.max_num_batched_tokens, llm.device) if spec is None else None
    engine = Engine(llm.model, llm.tokenizer, config, llm.device, graphs, "in-process", draft,
                    prompt_graphs=prompts, draft_graphs=draft_graphs)
    for g, cache in [(graphs, engine.cache)] + ([(draft_graphs, engine.drafter.cache)] if draft_graphs else []):
        cache.ptrs = g.cache_ptrs  # (a CPU cache has no addresses to keep: the capture's check of them, passed)
        g.capture(cache, engine.scratch_block)
        cache.ptrs = None
    return engine
