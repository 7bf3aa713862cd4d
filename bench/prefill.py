"""Prefill speed: engine steps that carry prompt tokens, timed whole and broken down by
operation against the GPU's compute limit, in one run.

A case is one step, written TOKENSxSEQS[cCACHED][+ROWS@CONTEXT]: TOKENS prompt tokens
split evenly over SEQS sequences, each with CACHED tokens of its prompt already in the
cache (a later chunk of a long prompt), beside ROWS decode rows (sequences computing one
token at CONTEXT tokens of context), e.g. "2048x8+64@1024". Its sequences are set up
untimed (their contexts computed beforehand), then the step runs through `Engine.run` as
the scheduler hands it over, `repeat` times from the same state, so each repetition does
the same work: its wall time (host and GPU; the median is reported), and the time a step
of as many queued one after another (`queued ms`: each prepared by the host while the GPU
computes the one before, as the engine's pipeline serves a long prompt's chunks). A few
more give each operation's own time on the GPU's timeline (step_profile.py: events around
the model's calls, idle gaps included) and, under the profiler, the GPU's busy time and its
top kernels. Host time is the wall time less the GPU's busy time. And the step as served
(replayed from the prompt graphs where it fits) is read off the GPU's timeline
(step_timeline.py): the host's time to its first kernel, the kernels' union, the idle
gaps between them, the time after the last.

The limit: the step's floating-point work (`step_flops`: the matrix products these tokens
need, attention's included, from the config) at the bf16 matrix rate measured in the
same run. `limit %` = that time / the measured step. A whole prompt (`prompts`) is also
timed through the scheduler, as a request is served: from its admission to its first
token, in steps of --max-num-batched-tokens.

The model is a checkpoint loaded in this process (`model`), or random weights of one of
make-checkpoint's shapes drawn straight into GPU memory (`shape`: no files to write).
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from itertools import accumulate
from pathlib import Path

import torch

from preload.bench.results import begin, finish, row
from preload.bench.step_profile import PROMPT, busy_kernels, operation_ms
from preload.bench.step_timeline import describe, step_timeline
from preload.checkpoint.config import ModelConfig
from preload.options import EngineOptions
from preload.worker.engine.flight import spans_of
from preload.worker.engine.prompt_graphs import PromptGraphs
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence
from preload.worker.model.kv_cache import bytes_per_token

CASE = re.compile(r"(\d+)x(\d+)(?:c(\d+))?(?:\+(\d+)@(\d+))?")
DEFAULT_CASES = ("256x1", "512x1", "1024x1", "2048x1", "4096x1", "8192x1", "2048x2", "2048x8", "2048x64",
                 "2048x1c8192", "2048x1c30720", "2048x8+64@1024", "512x1+64@1024", "2048x8+256@1024")


@dataclass(frozen=True)
class Case:
    tokens: int  # prompt tokens in the step
    seqs: int  # the sequences they are split over, evenly
    cached: int = 0  # each one's tokens already in the cache
    decode_rows: int = 0  # sequences computing one token each beside them
    decode_context: int = 0  # at this many tokens of context

    @classmethod
    def parse(cls, text: str) -> Case:
        m = CASE.fullmatch(text.strip())
        if not m:
            raise ValueError(f"{text!r}: a case is TOKENSxSEQS[cCACHED][+ROWS@CONTEXT], e.g. 2048x8+64@1024")
        case = cls(*(int(g) if g else 0 for g in m.groups()))
        if case.tokens < case.seqs or case.tokens % case.seqs or case.seqs < 1:
            raise ValueError(f"{text!r}: TOKENS must split evenly over SEQS (at least one token each)")
        return case

    @property
    def label(self) -> str:
        return (f"{self.tokens}x{self.seqs}" + (f"c{self.cached}" if self.cached else "")
                + (f"+{self.decode_rows}@{self.decode_context}" if self.decode_rows else ""))

    @property
    def per_seq(self) -> int:
        return self.tokens // self.seqs

    def cache_tokens(self, block_size: int) -> int:
        """Cache slots its sequences take, in whole blocks."""
        def whole(n: int) -> int:
            return -(-n // block_size) * block_size

        return self.seqs * whole(self.cached + self.per_seq) + self.decode_rows * whole(self.decode_context + 1)


def step_flops(cfg: ModelConfig, case: Case) -> dict[str, float]:
    """Floating-point operations of one step of `case`, by operation (step_profile's
    labels): the matrix products the model needs, with MLA's prompt attention in the
    expanded form (its cached context up-projected once) and decode rows' in the absorbed
    one. Elementwise work (norms, rope, softmax) is left out: it is not what bounds a step."""
    t = case.tokens + case.decode_rows
    d, h = cfg.hidden_size, cfg.num_heads
    dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    dense = cfg.num_layers - moe
    q = d * cfg.q_lora_rank + cfg.q_lora_rank * h * (dn + dr) if cfg.q_lora_rank else d * h * (dn + dr)
    projections = q + d * (r + dr) + h * dv * d
    n, c = case.per_seq, case.cached
    pairs = case.seqs * (n * c + n * (n + 1) // 2)  # (query, visible key) pairs, causal
    ctx = case.decode_context + 1
    per_row = h * (dn * r + ctx * (r + dr) + ctx * r + r * dv)  # absorbed: q W_uk, scores, weighted latents, W_uv
    L = cfg.num_layers
    return {
        "dense projections": 2 * t * L * projections,
        "dense MLP": 2 * t * dense * 3 * d * cfg.intermediate_size,
        "shared experts": 2 * t * moe * 3 * d * cfg.moe_intermediate_size * cfg.n_shared_experts,
        "routing": 2 * t * moe * cfg.n_routed_experts * d,
        "routed experts: grouped GEMMs": 2 * t * moe * cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size,
        "attention: prompt, flash": 2 * L * pairs * h * (dn + dr + dv),
        PROMPT: 2 * L * case.seqs * (c + n) * r * h * (dn + dv),  # (its own time is mostly the up-projection)
        "attention: decode rows": 2 * L * case.decode_rows * per_row,
        "output head": 2 * (case.seqs + case.decode_rows) * d * cfg.vocab_size,
    }


def matmul_rate(device: torch.device, times: int = 10) -> float:
    """FLOP/s of a bf16 matrix product on random data (torch; 8192 x 8192 x 8192 on a GPU),
    best of `times`."""
    n = 8192 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(times):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Step:
    """One case's sequences, their contexts in the cache, and the step over them, which
    `run` computes from the same state every time."""

    def __init__(self, engine, case: Case, vocab: int, seed: int):
        self.engine, self.case = engine, case
        gen = torch.Generator().manual_seed(seed)
        params = SamplingParams(max_tokens=4, ignore_eos=True)

        def sequence(length: int, reach: int) -> Sequence:
            seq = Sequence(torch.randint(10, vocab, (length,), generator=gen).tolist(), params)
            engine.add(seq)  # (its detokenizer and cache source; the step is handed over below, not scheduled)
            engine.blocks.grow(seq, reach)
            return seq

        c, n = case.cached, case.per_seq
        self.decoding = [sequence(case.decode_context, case.decode_context + 1) for _ in range(case.decode_rows)]
        self.prompts = [sequence(c + n, c + n) for _ in range(case.seqs)]
        engine.scheduler.waiting.clear()
        self._fill([(s, 0, case.decode_context) for s in self.decoding] + [(s, 0, c) for s in self.prompts if c])
        self.first = [int(t) for t in torch.randint(10, vocab, (case.decode_rows,), generator=gen)]
        self.batch = [(s, 1) for s in self.decoding] + [(s, n) for s in self.prompts]

    def _fill(self, spans: list[tuple[Sequence, int, int]], most: int = 8192) -> None:
        """Compute the cached contexts, at most `most` tokens a forward (untimed)."""
        while spans:
            taken, room = [], most
            while spans and room:
                seq, start, n = spans.pop(0)
                k = min(n, room)
                taken.append((seq, start, k))
                room -= k
                if k < n:
                    spans.insert(0, (seq, start + k, n - k))
            self.engine.forward(taken, [0])

    def _reset(self) -> None:
        for seq, first in zip(self.decoding, self.first):
            seq.computed, seq.output[:] = self.case.decode_context, [first]
        for seq in self.prompts:
            seq.computed, seq.output[:] = self.case.cached, []

    def run(self) -> None:
        self._reset()
        self.engine.run(self.batch)

    def launch(self) -> torch.Tensor:
        """The step's forward, not waited for: what the engine's pipeline queues while the
        GPU still computes the step before (a long prompt's next chunk). The log-probs of
        each sequence's last row."""
        self._reset()
        spans = spans_of(self.batch)
        return self.engine.forward(spans, [end - 1 for end in accumulate(n for _, _, n in spans)])[0]

    def release(self) -> None:
        for seq in self.decoding + self.prompts:
            self.engine.blocks.release(seq)


def time_step(step: Step, repeat: int) -> list[float]:
    """Seconds of `repeat` runs of the step (each ends when its tokens are on the host)."""
    spent = []
    for _ in range(repeat):
        sync(step.engine.device)
        t = time.perf_counter()
        step.run()
        spent.append(time.perf_counter() - t)
    return spent


def back_to_back(step: Step, times: int) -> float:
    """Seconds a step takes when `times` of it are queued one after another with one wait at
    the end: each prepared by the host while the GPU computes the one before, as served."""
    sync(step.engine.device)
    t = time.perf_counter()
    for _ in range(times):
        step.launch()
    sync(step.engine.device)
    return (time.perf_counter() - t) / times


def run_case(engine, cfg: ModelConfig, case: Case, rate: float, repeat: int, profile_times: int) -> dict:
    """The step as served (replayed from the prompt graphs where the engine has them and
    the step fits), then eagerly: its wall time, and the breakdown, which needs the model's
    calls (a replay makes none but attention's)."""
    step = Step(engine, case, cfg.vocab_size, seed=case.tokens + case.seqs)
    graphs = engine.prompt_graphs
    replayed = graphs is not None and graphs.fits(case.tokens + case.decode_rows)
    try:
        time_step(step, 2)  # warm-up: kernels of these shapes compiled (the bucket captured), the allocator's pools grown
        spent = sorted(time_step(step, repeat))
        wall = spent[len(spent) // 2]
        queued = back_to_back(step, repeat)
        served = step_timeline(step.run, profile_times) if engine.device.type == "cuda" else None
        engine.prompt_graphs = None
        time_step(step, 1)
        eager = sorted(time_step(step, repeat))[repeat // 2] if replayed else wall
        ops, span, busy, top = {}, None, None, []
        if engine.device.type == "cuda":  # (the spans and the profiler are the GPU's)
            ops, span = operation_ms(step.run, profile_times)
            busy, top = busy_kernels(step.run, profile_times)
    finally:
        engine.prompt_graphs = graphs
        step.release()
    flops = step_flops(cfg, case)
    total = sum(flops.values())
    breakdown = [{"operation": op, "ms": ms, "share": ms / span,
                  "tflop_s": flops[op] / (ms / 1e3) / 1e12 if flops.get(op) and ms > 0 else None}
                 for op, ms in sorted(ops.items(), key=lambda kv: -kv[1])]
    return asdict(case) | {"case": case.label, "replayed": replayed, "eager_ms": 1000 * eager,
                           "ms": 1000 * wall, "queued_ms": 1000 * queued,
                           "ms_min": 1000 * spent[0], "ms_max": 1000 * spent[-1],
                           "prompt_tok_s": case.tokens / wall, "tok_s": (case.tokens + case.decode_rows) / wall,
                           "tflop": total / 1e12, "limit_ms": 1000 * total / rate,
                           "limit_percent": 100 * total / rate / wall, "gpu_span_ms": span, "gpu_busy_ms": busy,
                           "host_ms": 1000 * eager - busy if busy is not None else None, "breakdown": breakdown,
                           "top_kernels": top, "timeline": served}


def run_prompt(engine, vocab: int, length: int) -> dict:
    """A prompt of `length` tokens from admission to its first token, through the scheduler."""
    seq = Sequence(torch.randint(10, vocab, (length,)).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.add(seq)
    sync(engine.device)
    t, steps, drawn = time.perf_counter(), 0, False
    while not drawn:  # (its first token landed: a step launched ahead books a placeholder in its output first)
        drawn = any(out.seq_id == seq.id and out.token_ids for out in engine.step())
        steps += 1
    spent = time.perf_counter() - t
    while engine.has_work():
        engine.step()
    return {"prompt": length, "s": spent, "steps": steps, "prompt_tok_s": length / spent}


def model_config(model: Path | None, shape: str | None) -> ModelConfig:
    from preload.bench.checkpoint import SHAPES

    return ModelConfig.from_dir(model) if model is not None else ModelConfig.from_dict(SHAPES[shape](1))


def build_engine(model: Path | None, shape: str | None, quant: str, device: torch.device, options: EngineOptions):
    """(engine, config) of a checkpoint loaded in this process or random weights of `shape`."""
    if model is not None:
        from preload.worker.llm import LLM

        llm = LLM(model, quant=quant, device=str(device), engine=options)
        return llm.engine, llm.config
    from preload.bench.checkpoint import SHAPES, random_weights, word_level_tokenizer
    from preload.checkpoint.tokenizer import Tokenizer
    from preload.worker.engine.engine import Engine
    from preload.worker.model.deepseek import Transformer

    cfg = model_config(None, shape)
    weights = random_weights(SHAPES[shape](1), quant, torch.bfloat16, str(device))
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    tokenizer = Tokenizer(*word_level_tokenizer(cfg.vocab_size, cfg.bos_token_id, eos))
    return Engine(Transformer(cfg, weights), tokenizer, options, device), cfg


def prefill_engine(model: Path | None, shape: str | None, quant: str, dev: torch.device, cases: list[Case],
                   prompts: list[int], max_num_batched_tokens: int, graphs: bool):
    """(engine, config) with a cache for the largest of `cases` and `prompts`, its prompt
    steps replayed from graphs where `graphs` (on a GPU) as a worker's are."""
    cfg = model_config(model, shape)
    options = EngineOptions(max_num_seqs=1024, enforce_eager=True, enable_prefix_caching=False,
                            max_num_batched_tokens=max_num_batched_tokens)
    slots = max([c.cache_tokens(options.block_size) for c in cases] + [n + options.block_size for n in prompts])
    options = replace(options, kv_cache_memory=slots * bytes_per_token(cfg, cfg.num_layers, torch.bfloat16))
    engine, cfg = build_engine(model, shape, quant, dev, options)
    if graphs and dev.type == "cuda":  # (the engine is built eager: the decode steps here are few)
        engine.prompt_graphs = PromptGraphs(engine.model, max_num_batched_tokens, dev)
    return engine, cfg


def run_prefill(model: Path | None, shape: str | None, device: str, quants: list[str], cases: list[Case],
                prompts: list[int], max_num_batched_tokens: int, repeat: int, progress: Callable[[str], None],
                profile_times: int = 3, graphs: bool = True) -> dict:
    """`graphs`: steps replayed from prompt graphs as a worker serves them (on a GPU)."""
    t0 = time.perf_counter()
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    result = begin("prefill", device) | {"model": str(model) if model else f"random weights, {shape} shapes",
                                         "max_num_batched_tokens": max_num_batched_tokens, "prompt_graphs": graphs,
                                         "runs": [], "prompts": []}
    if dev.type == "cuda":
        result["machine"]["cuda_device"] = torch.cuda.get_device_name(dev)
    rate = matmul_rate(dev)
    result["matmul_flop_s"] = rate
    for quant in quants:
        progress(f"{quant}: building the engine")
        t = time.perf_counter()
        engine, cfg = prefill_engine(model, shape, quant, dev, cases, prompts, max_num_batched_tokens, graphs)
        result.setdefault("engine_start_s", {})[quant] = time.perf_counter() - t
        for case in cases:
            progress(f"{quant}: step {case.label}")
            try:
                result["runs"].append(run_case(engine, cfg, case, rate, repeat, profile_times) | {"quant": quant})
            except (RuntimeError, ValueError) as e:  # (a case too large for the device, say: the others still run)
                result["runs"].append({"quant": quant, "case": case.label, "error": f"{type(e).__name__}: {e}"})
                progress(f"{quant}: step {case.label} failed: {e}")
        for length in prompts:
            progress(f"{quant}: a {length}-token prompt")
            run_prompt(engine, cfg.vocab_size, min(length, 64))  # warm-up
            result["prompts"].append(run_prompt(engine, cfg.vocab_size, length) | {"quant": quant})
        del engine
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return finish(result, t0)


def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [f"preload bench prefill: {result['model']}, on {m.get('cuda_device') or m.get('cpu_model')}; bf16 matmul "
             f"{result['matmul_flop_s'] / 1e12:.0f} TFLOP/s; budget {result['max_num_batched_tokens']} tokens a step;"
             f" {result['wall_s']:.0f} s", ""]
    head = ("quant", "step", "ms", "queued ms", "prompt tok/s", "TFLOP", "limit ms", "limit %", "eager ms", "GPU busy",
            "host ms")
    widths = (10, 18, 8, 9, 12, 7, 8, 7, 8, 8, 8)
    lines.append(row(head, widths))

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for r in result["runs"]:
        if "error" in r:
            lines.append(row((r["quant"], r["case"], "failed: " + r["error"][:80]), (10, 18, 8)))
            continue
        lines.append(row((r["quant"], r["case"], ms(r["ms"]), ms(r.get("queued_ms")), f"{r['prompt_tok_s']:.0f}",
                          f"{r['tflop']:.2f}", ms(r["limit_ms"]), f"{r['limit_percent']:.0f}", ms(r.get("eager_ms")),
                          ms(r["gpu_busy_ms"]), ms(r["host_ms"])),
                         widths))
    for p in result["prompts"]:
        lines.append(f"{p['quant']}: a {p['prompt']}-token prompt to its first token: {p['s']:.3f} s in {p['steps']}"
                     f" steps, {p['prompt_tok_s']:.0f} tok/s")
    timelines = [r for r in result["runs"] if r.get("timeline")]
    if timelines:
        lines += ["", "each step as served (replayed where it fits), on the GPU's timeline, under the profiler (which"
                      " slows the host's parts):"]
        lines += [f"  {r['quant']} {r['case']}: " + describe(r["timeline"]) for r in timelines]
    for r in result["runs"]:
        if not r.get("breakdown"):
            continue
        lines += ["", f"{r['quant']} {r['case']} eagerly: {r.get('eager_ms', r['ms']):.2f} ms a step, {r['gpu_span_ms']:.2f}"
                      f" ms of it on the GPU's timeline, {r['gpu_busy_ms']:.2f} ms busy"]
        lines += [f"  {b['ms']:8.3f} ms {100 * b['share']:5.1f}%  "
                  + (f"{b['tflop_s']:6.0f} TFLOP/s  " if b["tflop_s"] else " " * 16) + b["operation"]
                  for b in r["breakdown"]]
    return "\n".join(lines)
