"""Short requests behind long ones: `count` long prompts and `count` short ones queued at
once (the long ones first), with and without `--long-prefill-token-threshold`; time to
first token of each, on the engine a worker runs (in-process), stepped until every
request has its first token. Without the threshold the short ones wait for every long
prefill ahead of them; with it, the long prefills go in chunks shared among them and the
short ones are admitted in the first steps.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from preload.bench.results import begin, finish, quantiles, row
from preload.options import EngineOptions
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence


def ttfts(llm, long_len: int, short_len: int, count: int) -> tuple[list[float], list[float]]:
    rng = random.Random(0)
    vocab = llm.config.vocab_size
    make = lambda n: Sequence([rng.randrange(10, vocab) for _ in range(n)], SamplingParams(max_tokens=2))  # noqa: E731
    longs, shorts = [make(long_len) for _ in range(count)], [make(short_len) for _ in range(count)]
    engine, first = llm.engine, {}
    t0 = time.perf_counter()
    for seq in longs + shorts:
        engine.check(seq)
        engine.add(seq)
    while len(first) < 2 * count:
        for out in engine.step():
            first.setdefault(out.seq_id, time.perf_counter() - t0)
    while engine.has_work():
        engine.step()
    return [first[s.id] for s in longs], [first[s.id] for s in shorts]


def run_scheduling(model: Path, device: str, count: int, long_len: int, short_len: int, threshold: int,
                   progress=lambda msg: None) -> dict:
    from preload.worker.llm import LLM

    t0 = time.perf_counter()
    result = begin("scheduling", device) | {"model": str(model), "count": count, "long_len": long_len,
                                            "short_len": short_len, "threshold": threshold, "runs": {}}
    for label, value in (("off", 0), ("on", threshold)):
        progress(f"long-prefill threshold {value or 'off'}")
        llm = LLM(model, device=device, engine=EngineOptions(long_prefill_token_threshold=value, max_num_seqs=2 * count,
                                                             enable_prefix_caching=False))
        ttfts(llm, 32, 8, 2)  # warm-up
        long_s, short_s = ttfts(llm, long_len, short_len, count)
        result["runs"][label] = {"short_ttft_s": quantiles(short_s, (50, 99)), "long_ttft_s": quantiles(long_s, (50, 99))}
        del llm
    return finish(result, t0)


def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [f"preload bench scheduling: {result['model']}, {result['count']} prompts of {result['long_len']} tokens then "
             f"{result['count']} of {result['short_len']}, queued at once, on {m.get('cuda_device') or m.get('cpu_model')};"
             f" {result['wall_s']:.0f} s", ""]
    widths = (26, 12, 12, 12, 12)
    lines.append(row(("long-prefill threshold", "short p50", "short p99", "long p50", "long p99"), widths))
    for label in ("off", "on"):
        r = result["runs"][label]
        name = "off" if label == "off" else f"{result['threshold']} tokens"
        lines.append(row((name, *(f"{r[k][q]:.3f} s" for k in ("short_ttft_s", "long_ttft_s") for q in ("p50", "p99"))),
                         widths))
    return "\n".join(lines)
