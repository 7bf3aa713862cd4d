"""Decode speed: output tokens per second and milliseconds per step of the engine, at
several batch sizes and context lengths, against the memory-bandwidth limit and
against transformers `generate` on the same checkpoint, in one run.

For each quant mode the checkpoint is loaded in this process (`LLM`, the engine a
worker runs) with a KV cache large enough for the largest batch at the longest context.
For each (context, batch): `batch` prompts of `context` random tokens, greedy, exactly
`output_len` tokens each (EOS ignored). The prefill (every prompt computed and its first
token drawn, before any sequence decodes: `prefill`) and the decode (the remaining
output_len - 1 steps, every sequence in each) are timed apart; decode tok/s is
batch * (output_len - 1) / decode seconds. With drafts (speculative decoding: the MTP
layer's, or with `draft_model` a small model's of the same vocabulary) a "step" is a verify
pass: ms/step is per pass, tok/s counts tokens; beside the same case without drafts, its
step's time ratio, the least that ratio can be by the bytes the drafts add (`step_floor`),
the speedup measured, and the speedups the ratio allows at acceptances 0.5 / 0.7 / 0.9
(`add_speedups`).

The limit: a decode step must read every weight it uses once (dense layers, attention,
shared experts, the output head, and the routed experts that the batch's tokens touch,
expected for uniform routing: E (1 - (1 - k/E)^batch) per layer) and the batch's cached
context; that many bytes at the device's copy bandwidth, measured in the same run, is
the fastest a step can be. `hbm_percent` = that time / the measured step.
"""

from __future__ import annotations

import gc
import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from preload.bench.results import begin, finish, row
from preload.checkpoint.config import ModelConfig
from preload.checkpoint.shapes import checkpoint_shapes, mtp_shapes
from preload.kernels.quant import stored_layout
from preload.options import EngineOptions
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence, Status
from preload.worker.model.kv_cache import bytes_per_token


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), best of five."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def _weight_bytes(cfg: ModelConfig, shapes: dict, quant: str, dtype: torch.dtype, rows: int) -> float:
    """Bytes of `shapes` a step of `rows` tokens reads: the embedding's rows looked up, the
    routed experts the rows touch (expected, routing uniform), every other tensor whole."""
    dense, per_expert = 0, {}
    for name, shape in shapes.items():
        nbytes = sum(dt.itemsize * torch.Size(s).numel() for dt, s in stored_layout(name, shape, quant, dtype).values())
        if name == "model.embed_tokens.weight":
            nbytes = nbytes // cfg.vocab_size * rows  # only the rows looked up
        if ".experts." in name:
            layer = int(name.split(".")[2])
            per_expert[layer] = per_expert.get(layer, 0) + nbytes / cfg.n_routed_experts
        else:
            dense += nbytes
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** rows) if e else 0
    return dense + sum(per_expert.values()) * touched


def step_bytes(cfg: ModelConfig, quant: str, dtype: torch.dtype, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` sequences at `context` tokens must read."""
    cache = batch * context * bytes_per_token(cfg, cfg.num_layers, dtype)
    return int(_weight_bytes(cfg, checkpoint_shapes(cfg, with_mtp=False), quant, dtype, batch) + cache)


def draft_step_bytes(cfg: ModelConfig, quant: str, dtype: torch.dtype, batch: int, context: int,
                     draft: ModelConfig | None = None) -> int:
    """Bytes one draft step of `batch` sequences must read: the MTP layer's block (its own
    experts as the rows touch them, its layer's cache) and the output head it shares with
    the target; or, with `draft`, the draft model's whole step."""
    if draft is not None:
        return step_bytes(draft, "none", dtype, batch, context)
    shapes = mtp_shapes(cfg) | {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}  # (the head, tied or not)
    return int(_weight_bytes(cfg, shapes, quant, dtype, batch) + batch * context * bytes_per_token(cfg, 1, dtype))


def step_floor(cfg: ModelConfig, quant: str, dtype: torch.dtype, batch: int, context: int, k: int,
               draft: ModelConfig | None = None) -> float:
    """The least a step with k drafts can take over one without, by bytes read: the verify
    pass's k + 1 rows a sequence (each reading its context, touching experts of its own)
    and k draft steps, over the plain step's; routing taken uniform, as random weights
    route (a trained model's neighbouring tokens share experts more). On v3-slice a draft
    step reads 0.77 of a plain step's bytes at batch 1 (the MTP block, the shared 1.85 GB
    head), and two verify rows touch twice the experts: 1.93x with one draft, before any
    kernel's cost."""
    verify = step_bytes(cfg, quant, dtype, batch * (k + 1), context)
    drafts = k * draft_step_bytes(cfg, quant, dtype, batch, context, draft)
    return (verify + drafts) / step_bytes(cfg, quant, dtype, batch, context)


def queue(engine, batch: int, context: int, output_len: int, vocab: int, seed: int) -> list[Sequence]:
    """`batch` prompts of `context` random tokens, greedy, exactly `output_len` tokens each."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    seqs = [Sequence(torch.randint(10, vocab, (context,), generator=gen).tolist(), params) for _ in range(batch)]
    for seq in seqs:
        engine.check(seq)
        engine.add(seq)
    return seqs


def prefill(engine, seqs: list[Sequence]) -> int:
    """Every prompt computed, and its first token drawn, in steps of at most the engine's
    token budget, before any sequence decodes; then all of them run, decoding together.
    (Left to the scheduler, the first sequences would decode while the last are still
    prefilled: at batch 256 and 1k tokens, or 16 and 32k, they finished before the decode
    steps timed after the prefill, which then carried fewer sequences than the batch.)
    The number of steps."""
    engine.scheduler.waiting.clear()  # (queued by `queue`; handed to the running batch below instead)
    todo, steps = deque(seqs), 0
    while todo:
        batch, room = [], engine.scheduler.max_num_batched_tokens
        while todo and room:
            seq = todo[0]
            n = min(seq.pending, room)
            engine.blocks.grow(seq, seq.computed + n)
            batch.append((seq, n))
            room -= n
            if n == seq.pending:
                todo.popleft()
        engine.run(batch)
        steps += 1
    for seq in seqs:
        seq.status = Status.RUNNING
    engine.scheduler.running.extend(seqs)
    return steps


def run_case(llm, batch: int, context: int, output_len: int, vocab: int, seed: int) -> dict:
    """One (batch, context): prefill and decode timed apart on `llm`'s engine."""
    engine = llm.engine
    seqs = queue(engine, batch, context, output_len, vocab, seed)
    t0 = time.perf_counter()
    steps = prefill(engine, seqs)
    t1 = time.perf_counter()
    decode_steps, drawn = 0, sum(len(seq.output) for seq in seqs)
    while engine.has_work():
        engine.step()
        decode_steps += 1
    t2 = time.perf_counter()
    assert all(len(seq.output) == output_len for seq in seqs)
    decode_s, decoded = t2 - t1, batch * output_len - drawn  # (the tokens drawn in the timed steps, as counted)
    return {"batch": batch, "context": context, "prefill_s": t1 - t0, "prefill_steps": steps,
            "prefill_tok_s": batch * context / (t1 - t0), "decode_s": decode_s, "decode_steps": decode_steps,
            "ms_per_step": 1000 * decode_s / max(decode_steps, 1), "tokens_per_step": decoded / max(decode_steps, 1),
            "output_tok_s": decoded / decode_s}


def profile_steps(llm, batch: int, context: int, vocab: int, steps: int = 5, top: int = 40) -> dict:
    """Where a decode step's GPU time goes: `steps` decode steps of `batch` sequences under
    torch.profiler; the kernels that take most of it, per step."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    prefill(engine, queue(engine, batch, context, steps + 32, vocab, seed=1))  # (the prefill: not what is profiled)
    torch.cuda.synchronize()  # (a step launched ahead before the window runs outside it)
    ahead = launched_ahead(engine)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        # The steps the GPU ran in the window: each call lands one, and the last call's launch
        # ahead runs in it too (-> kernels 1.2 times a step, time 20% over, when 5 were counted).
        steps = steps - ahead + launched_ahead(engine)
        wall = (time.perf_counter() - t) / steps
    host = host_profile(engine)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / steps
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return {"batch": batch, "context": context, "wall_ms": 1000 * wall, "gpu_busy_ms": busy / 1000,
            "replay_ms": replay_ms(llm, batch), "launch_us": launch_us(llm, batch), "host_top": host,
            "launches_per_step": sum(e.count for e in kernels) / steps,
            "top": [{"kernel": e.key[:90], "us_per_step": e.self_device_time_total / steps, "calls_per_step": e.count / steps}
                    for e in kernels[:top]]}


def launched_ahead(engine) -> int:
    """1 while a decode step launched ahead has not landed (engine/pipeline.py), else 0."""
    return int(engine.pipeline is not None and engine.pipeline.flight is not None)


def host_profile(engine, top: int = 15) -> list[dict]:
    """Where the host's share of the remaining steps goes (cProfile; a function's own time,
    per step, a wait for the GPU counted where it happens): the top `top` functions."""
    import cProfile
    import pstats

    steps = 0
    with cProfile.Profile() as prof:
        while engine.has_work():
            engine.step()
            steps += 1
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}"[-90:], "us_per_step": 1e6 * own / max(steps, 1),
             "calls_per_step": calls / max(steps, 1)} for (f, line, name), (calls, _, own, _, _) in rows]


def replay_ms(llm, batch: int, times: int = 50) -> float | None:
    """A decode graph's replays back to back, nothing between them: the step's GPU time
    with its kernels' launch gaps, without the host's share (scheduling, sampling, copies)."""
    graph = decode_graph(llm, batch)
    if graph is None:
        return None
    graph.replay()  # (its inputs are the last step's: a replay reads and writes only the graph's buffers and the cache)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(times):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / times


def launch_us(llm, batch: int) -> float | None:
    """The host's time in a decode graph's launch with the GPU idle: time the GPU waits
    at every step for the host to hand it the graph (unless steps are launched ahead)."""
    graph = decode_graph(llm, batch)
    return host_launch_us(graph) if graph is not None else None


def decode_graph(llm, batch: int) -> torch.cuda.CUDAGraph | None:
    """The decode graph a step of `batch` sequences replays (None: no graphs)."""
    graphs = llm.graphs
    if graphs is None or not graphs.graphs:
        return None
    return graphs.graphs[next(s for s in graphs.sizes if s >= batch)]


def host_launch_us(graph: torch.cuda.CUDAGraph, times: int = 30) -> float:
    """The median of `times` replays' host time, each with the GPU idle (microseconds)."""
    spent = []
    for _ in range(times):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        spent.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * sorted(spent)[times // 2]


def run_transformers(model: Path, device: str, batch: int, context: int, output_len: int, vocab: int) -> dict:
    """transformers `generate` on the same checkpoint: greedy, exactly output_len tokens."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, device_map=device).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab, (batch, context), generator=gen).to(device)
    kwargs = {"max_new_tokens": output_len, "min_new_tokens": output_len, "do_sample": False}
    with torch.inference_mode():
        hf.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, **kwargs)
        torch.cuda.synchronize()
        total = time.perf_counter() - t
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "total_s": total, "output_tok_s": batch * output_len / total}


def run_decode(model: Path, device: str, quants: list[str], cases: list[tuple[int, int]], output_len: int,
               transformers: bool, progress: Callable[[str], None], enforce_eager: bool = False,
               profile: bool = False, speculative: tuple[int, ...] = (0,), async_scheduling: bool = True,
               draft_model: Path | None = None, drafts_ahead: bool = False) -> dict:
    from preload.worker.llm import LLM

    t0 = time.perf_counter()
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    result = begin("decode", device) | {"model": str(model), "output_len": output_len, "runs": [], "transformers": [],
                                        "cuda_graphs": dev.type == "cuda" and not enforce_eager,
                                        "async_scheduling": dev.type == "cuda" and async_scheduling,
                                        "drafts_ahead": drafts_ahead,
                                        "drafter": str(draft_model) if draft_model else "mtp"}
    if dev.type == "cuda":
        result["machine"]["cuda_device"] = torch.cuda.get_device_name(dev)
    bandwidth = copy_bandwidth(dev)
    result["copy_bandwidth_bytes_s"] = bandwidth
    cfg = ModelConfig.from_dir(model)
    draft_cfg = ModelConfig.from_dir(draft_model) if draft_model else None
    batches = sorted({b for b, _ in cases})
    first_context = cases[0][1]
    tokens = max(b * (c + output_len + 16) for b, c in cases)
    for quant, k in ((q, k) for q in quants for k in speculative):
        # Every token's cache: the target's, and the drafter's (an MTP layer, or a draft model's
        # layers: too small a cache preempted at batch 16 and timed the steps that followed).
        drafter_kv = bytes_per_token(draft_cfg, draft_cfg.num_layers, torch.bfloat16) if draft_cfg else \
            bytes_per_token(cfg, 1, torch.bfloat16)
        kv = tokens * (bytes_per_token(cfg, cfg.num_layers, torch.bfloat16) + drafter_kv)
        method = {"method": "draft_model", "model": str(draft_model)} if draft_model else {"method": "mtp"}
        spec = json.dumps(method | {"num_speculative_tokens": k}) if k else None
        drafter = "draft-model" if draft_model else "MTP"
        engine = EngineOptions(kv_cache_memory=kv, max_num_seqs=max(batches), enforce_eager=enforce_eager,
                               async_scheduling=async_scheduling, drafts_ahead=drafts_ahead, speculative_config=spec,
                               enable_prefix_caching=False)  # (random prompts: no hits anyway)
        t = time.perf_counter()
        llm = LLM(model, quant=quant, device=str(dev), engine=engine)
        label = f"{quant}, {k} {drafter} drafts" if k else quant
        result.setdefault("engine_start_s", {})[label] = time.perf_counter() - t  # load, and capture unless eager
        for batch in batches:  # warm-up: every kernel variant compiled, each batch's graphs captured (drafted
            run_case(llm, batch, 16, 4, cfg.vocab_size, seed=0)  # steps capture theirs at first use)
        gc.collect()
        gc.freeze()  # as a worker does once it serves (worker/serve.py)
        for batch, context in cases:
            progress(f"{label}: batch {batch}, context {context}")
            before = llm.engine.stats()
            case = run_case(llm, batch, context, output_len, cfg.vocab_size, seed=batch)
            after = llm.engine.stats()
            drafted = after.spec_draft_tokens - before.spec_draft_tokens
            accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
            mid = context + output_len // 2
            limit_s = step_bytes(cfg, quant, llm.dtype, batch, mid) / bandwidth
            case |= {"quant": quant, "hbm_percent": 100 * limit_s / (case["ms_per_step"] / 1000),
                     "speculative_tokens": k, "acceptance_rate": accepted / drafted if drafted else None,
                     "preemptions": after.preemptions - before.preemptions}
            if k:
                case["step_floor"] = step_floor(cfg, quant, llm.dtype, batch, mid, k, draft_cfg)
            result["runs"].append(case)
            if profile and context == first_context and dev.type == "cuda":
                result.setdefault("profiles", []).append(profile_steps(llm, batch, context, cfg.vocab_size) | {"quant": quant})
        gc.unfreeze()
        del llm
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    add_speedups(result["runs"])
    if transformers and dev.type == "cuda":
        for batch in [b for b in batches if b <= 16]:
            progress(f"transformers: batch {batch}, context {first_context}")
            result["transformers"].append(run_transformers(model, str(dev), batch, first_context, output_len,
                                                           cfg.vocab_size))
    return finish(result, t0)


ACCEPTANCES = (0.5, 0.7, 0.9)  # per-draft acceptance rates the speedups are also given at


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a sequence's verify step emits on average with k drafts, each accepted with
    probability `acceptance` until the first refusal, the target's own token included:
    1 + a + ... + a^k."""
    return sum(acceptance**i for i in range(k + 1))


def add_speedups(runs: list[dict]) -> None:
    """Beside each run with drafts, against the run without of the same quant, batch and
    context (if measured): its step's time over that one's (`step_ratio`), the speedup
    measured (tok/s over tok/s, at the acceptance it met), and the speedups the step ratio
    gives at ACCEPTANCES (expected tokens a step over the step ratio): what the drafts'
    cost allows whatever the drafter's quality on these random prompts."""
    plain = {(r["quant"], r["batch"], r["context"]): r for r in runs if not r["speculative_tokens"]}
    for r in runs:
        base = plain.get((r["quant"], r["batch"], r["context"]))
        if r["speculative_tokens"] and base is not None:
            r["step_ratio"] = r["ms_per_step"] / base["ms_per_step"]
            r["speedup"] = r["output_tok_s"] / base["output_tok_s"]
            r["speedup_at"] = {str(a): expected_tokens(r["speculative_tokens"], a) / r["step_ratio"] for a in ACCEPTANCES}


def format_table(result: dict) -> str:
    m = result["machine"]
    drafter = result.get("drafter", "mtp")
    lines = [f"preload bench decode: {result['model']}, {result['output_len']} output tokens, on "
             f"{m.get('cuda_device') or m.get('cpu_model')}; copy bandwidth "
             f"{result['copy_bandwidth_bytes_s'] / 1e12:.2f} TB/s; CUDA graphs {'on' if result.get('cuda_graphs') else 'off'};"
             + (f" steps launched ahead {'on' if result['async_scheduling'] else 'off'};" if "async_scheduling" in result else "")
             + ("" if drafter == "mtp" else f" drafts by {drafter};") + f" {result['wall_s']:.0f} s", ""]
    head = ("quant", "drafts", "context", "batch", "tok/s", "ms/step", "HBM %", "accepted", "step x", "floor x",
            "speedup", "at " + "/".join(f"{a:g}" for a in ACCEPTANCES), "prefill tok/s", "prefill s")
    widths = (14, 6, 8, 6, 10, 8, 6, 8, 6, 7, 7, 16, 13, 9)
    lines.append(row(head, widths))
    for r in result["runs"]:
        rate, at = r.get("acceptance_rate"), r.get("speedup_at")
        lines.append(row((r["quant"], r.get("speculative_tokens", 0), r["context"], r["batch"], f"{r['output_tok_s']:.1f}",
                          f"{r['ms_per_step']:.2f}", f"{r['hbm_percent']:.1f}", "-" if rate is None else f"{100 * rate:.0f}%",
                          f"{r['step_ratio']:.2f}" if "step_ratio" in r else "-",
                          f"{r['step_floor']:.2f}" if "step_floor" in r else "-",
                          f"{r['speedup']:.2f}" if "speedup" in r else "-",
                          "/".join(f"{v:.2f}" for v in at.values()) if at else "-",
                          f"{r['prefill_tok_s']:.0f}", f"{r['prefill_s']:.2f}"), widths))
    for r in result["transformers"]:
        lines.append(row(("transformers", "-", r["context"], r["batch"], f"{r['output_tok_s']:.1f}", "-", "-", "-", "-",
                          "-", "-", "-", "-", f"{r['total_s']:.2f}"), widths))
    for p in result.get("profiles", []):
        lines += ["", f"profile, {p['quant']}, batch {p['batch']}, context {p['context']}: {p['wall_ms']:.2f} ms a step,"
                      f" GPU busy {p['gpu_busy_ms']:.2f} ms, {p['launches_per_step']:.0f} kernels"
                      + (f", graph replay alone {p['replay_ms']:.2f} ms" if p.get("replay_ms") else "")
                      + (f", its launch on the host {p['launch_us']:.0f} us" if p.get("launch_us") else "")]
        lines += [f"  {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  {k['kernel']}" for k in p["top"]]
        if p.get("host_top"):
            lines += ["  host (own time per step, cProfile):"]
            lines += [f"  {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  {k['function']}" for k in p["host_top"]]
    return "\n".join(lines)
