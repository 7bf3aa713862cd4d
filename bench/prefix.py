"""Prefix caching: time to first token of a long shared system prompt, first and repeated,
and the hit rate of a multi-turn chat replay, on the engine a worker runs (in-process).

TTFT here is `generate(max_tokens=1)` of one request on an idle engine: the prefill of
what the cache does not hold, plus one sampled token. Each repeat ends in a different
user turn, so only the system prompt can be shared. The chat replay: `conversations`
chats of `turns` turns each, a turn sending the whole history back (system prompt,
earlier user turns and answers) plus a new user turn, conversations interleaved; the
hit rate is tokens found in the cache over tokens looked up, as /metrics counts them.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from preload.bench.results import begin, finish, row
from preload.options import EngineOptions


def run_prefix(model: Path, device: str, system_tokens: int, repeats: int, conversations: int, turns: int,
               progress=lambda msg: None) -> dict:
    from preload.worker.llm import LLM

    t0 = time.perf_counter()
    result = begin("prefix", device) | {"model": str(model), "system_tokens": system_tokens}
    rng = random.Random(0)
    runs = {}
    for caching in (False, True):
        progress(f"prefix caching {'on' if caching else 'off'}")
        llm = LLM(model, device=device, engine=EngineOptions(enable_prefix_caching=caching))
        vocab = llm.config.vocab_size
        words = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
        system = words(system_tokens)
        llm.generate([words(8)], max_tokens=1)  # warm-up
        ttft = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            llm.generate([system + words(12)], max_tokens=1)
            ttft.append(time.perf_counter() - t)
        s = llm.engine.stats()
        q0, h0 = s.prefix_queried_tokens, s.prefix_hit_tokens
        histories = [system[:256] + words(20) for _ in range(conversations)]
        for turn in range(turns):
            for c in range(conversations):
                answer = llm.generate([histories[c]], max_tokens=24, ignore_eos=True)[0].token_ids
                histories[c] = histories[c] + answer + words(20)
        s = llm.engine.stats()
        queried, hit = s.prefix_queried_tokens - q0, s.prefix_hit_tokens - h0
        runs["on" if caching else "off"] = {"first_ttft_s": ttft[0], "repeated_ttft_s": statistics.median(ttft[1:]),
                                            "chat_queried_tokens": queried, "chat_hit_tokens": hit,
                                            "chat_hit_rate": hit / queried if queried else None}
        del llm
    result["runs"] = runs
    result["conversations"], result["turns"], result["repeats"] = conversations, turns, repeats
    return finish(result, t0)


def format_table(result: dict) -> str:
    m, on, off = result["machine"], result["runs"]["on"], result["runs"]["off"]
    lines = [f"preload bench prefix: {result['model']}, a {result['system_tokens']}-token system prompt, on "
             f"{m.get('cuda_device') or m.get('cpu_model')}; {result['wall_s']:.0f} s", ""]
    widths = (22, 12, 16, 16)
    lines.append(row(("prefix caching", "first TTFT", "repeated TTFT", "chat hit rate"), widths))
    for label, r in (("off", off), ("on", on)):
        rate = "-" if r["chat_hit_rate"] is None else f"{100 * r['chat_hit_rate']:.1f}%"
        lines.append(row((label, f"{r['first_ttft_s']:.3f} s", f"{r['repeated_ttft_s']:.3f} s", rate), widths))
    lines += ["", f"repeated TTFT {off['repeated_ttft_s'] / on['repeated_ttft_s']:.1f}x faster with the cache; chat replay: "
                  f"{result['conversations']} conversations x {result['turns']} turns"]
    return "\n".join(lines)
