"""Serving load: N concurrent clients stream completions from a RUNNING worker.

What is sent, so the figures can be judged:
- prompts are lists of token ids drawn uniformly from [0, vocab) (seeded), so their
  lengths are exact; each length is uniform in --prompt-len. `vocab` comes from --vocab,
  or is found by bisection with one-token scoring requests (`max_tokens: 0, echo: true`),
  which the worker refuses with a 400 exactly when an id is outside its vocabulary;
- each request streams (`stream: true`) with `ignore_eos: true`, `temperature: 0` and
  `max_tokens` uniform in --output-len, so every request generates exactly what was
  asked, and `stream_options.include_usage`, so token counts are the server's own;
- a closed loop: --concurrency clients, each sending its next request as soon as the
  previous one ends, until --requests have been sent (plus --warmup unrecorded ones);
- after the warm-up, and before the recorded run, the bench waits for the workers to have
  captured all their CUDA graphs (/metrics' preload_engine_graphs_pending at 0): a fresh
  worker captures a bucket at its first step of that size, 0.1-0.6 s each on the H200,
  which a run begun earlier would count as serving time.

What is reported:
- throughput over the wall time of the recorded requests: requests/s, output tokens/s
  and total (prompt + output) tokens/s;
- TTFT: request sent -> first streamed chunk that carries tokens;
- ITL: the gaps between consecutive token-carrying chunks of a request, as a client
  sees them (the worker sends one chunk per engine step, so one gap per token);
- TPOT: per request, (last chunk - first chunk) / (output tokens - 1);
- end-to-end latency per request; and failures (non-200, broken stream, short output);
- the client's own CPU time over the run's wall time: one process reads every stream (100
  streams at 11 ms a step are ~9,000 chunks a second, ~44 us of aiohttp each on the CPU
  machine), and one busy near a whole core reads chunks late, which the ITL then counts;
- from the worker's /metrics, scraped before and after (where it has them): the engine
  steps the run took by kind, their mean time, and the share of the decode steps
  launched ahead that the host spent waiting on the GPU (worker/engine/step_clock.py):
  whether decoding was bound by the GPU or by the host.

With `rolling_restarts` (and the daemon's state dir), the same requests run a second
time while `preload restart` replaces every worker that many times in a row, from the
moment that run begins, and over again until the last restart has ended (so that every
restart meets requests in flight): what clients see of rolling restarts, beside the
steady run.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from preload.bench.driver import preload
from preload.bench.results import host_info, quantiles
from preload.worker.engine.step_clock import KINDS

PERCENTILES = (50, 90, 99)
STEP_SERIES = {"preload_engine_steps_total": "steps", "preload_engine_step_seconds_total": "seconds",
               "preload_engine_gpu_wait_seconds_total": "gpu_wait"}
STEPS_SETTLE = 0.3  # seconds for the workers' last step figures to reach /metrics (a beat) after the run
GRAPHS_PENDING = "preload_engine_graphs_pending"
GRAPHS_TIMEOUT = 600.0  # seconds to wait, before the run, for the workers' CUDA graphs to be captured
RESTART_TIMEOUT = 600.0  # seconds for one `preload restart` round
CLIENT_BUSY = 0.8  # the load generator's CPU share above which its table says its latencies are partly its own


@dataclass
class RequestRecord:
    prompt_tokens: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    sent: float = 0.0  # seconds since the recorded run began
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # of its prompt, found in the server's prefix cache (usage.prompt_tokens_details)
    chunk_gaps: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        """First token-carrying chunk to the last, per further token."""
        if not self.ok or self.output_tokens < 2:
            return None
        return sum(self.chunk_gaps) / (self.output_tokens - 1)


def parse_range(text: str) -> tuple[int, int]:
    """'64:256' -> (64, 256); '128' -> (128, 128)."""
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise ValueError(f"{text!r}: want LO:HI with 1 <= LO <= HI, or one number")
    return a, b


def client_session(url: str, connections: int) -> aiohttp.ClientSession:
    """The load generator's HTTP client. aiohttp, as vLLM's serving benchmark uses: one
    process reads every stream, and on the CPU machine it spent ~44 us a streamed chunk where
    httpx spent ~74 (100 streams at 11 ms a step are ~9,000 chunks a second). Requests name
    their paths relative ("v1/models"): a `url` with a path of its own (a proxy's prefix)
    keeps it, where aiohttp would replace it with an absolute one."""
    return aiohttp.ClientSession(base_url=url.rstrip("/") + "/", timeout=aiohttp.ClientTimeout(total=60),
                                 connector=aiohttp.TCPConnector(limit=connections))


async def server_info(client: aiohttp.ClientSession) -> dict:
    async with client.get("v1/models", raise_for_status=True) as r:
        card = (await r.json())["data"][0]
    return {"model": card["id"], "max_model_len": card.get("max_model_len")}


async def discover_vocab(client: aiohttp.ClientSession, model: str, limit: int = 1 << 22) -> int:
    """The smallest id the worker refuses as outside its vocabulary, by bisection."""

    async def valid(token: int) -> bool:
        async with client.post("v1/completions", json={"model": model, "prompt": [token], "max_tokens": 0,
                                                        "echo": True}) as r:
            text = await r.text()
        if r.status == 200:
            return True
        if r.status == 400 and "vocab" in text:
            return False
        raise RuntimeError(f"probing the vocabulary with id {token}: {r.status} {text[:200]}")

    if not await valid(0):
        raise RuntimeError("the worker refuses token id 0; pass --vocab")
    lo, hi = 0, limit  # lo valid, hi assumed invalid
    if await valid(hi - 1):
        return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if await valid(mid) else (lo, mid)
    return hi


def make_requests(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(*prompt_len)
        out.append(([rng.randrange(vocab) for _ in range(p)], rng.randint(*output_len)))
    return out


SET_BY_THE_BENCH = ("model", "prompt", "max_tokens", "ignore_eos", "stream", "stream_options", "n")


def request_fields(model: str, extra: dict | None = None) -> dict:
    """What every request of a run sends but its prompt and length: greedy, streamed, every
    token asked for generated; `extra` (--extra-body) merged in, except the fields the
    bench's counts rest on (ValueError naming them)."""
    extra = extra or {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    if fixed := sorted(set(extra) & set(SET_BY_THE_BENCH)):
        raise ValueError(f"--extra-body may not set {', '.join(fixed)}: the bench sets them to count what it times")
    return {"model": model, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}} | extra


async def one_request(client: aiohttp.ClientSession, fields: dict, prompt: list[int], max_tokens: int, t0: float,
                      timeout: float) -> RequestRecord:
    rec = RequestRecord(len(prompt), max_tokens)
    body = fields | {"prompt": prompt, "max_tokens": max_tokens}
    start = time.perf_counter()
    rec.sent = start - t0
    last = None
    usage = None
    done = False
    try:
        async with client.post("v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:200]}"
                return rec
            async for line in r.content:  # (lines as they arrive)
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                now = time.perf_counter()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"error in stream: {chunk['error'].get('message')}"
                    return rec
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices"):
                    if last is None:
                        rec.ttft = now - start
                    else:
                        rec.chunk_gaps.append(now - last)
                    last = now
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # (json.JSONDecodeError is a ValueError)
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.latency = time.perf_counter() - start
    if not done:
        rec.error = "stream ended without [DONE]"
    elif usage is None:
        rec.error = "no usage chunk"
    elif usage["completion_tokens"] != max_tokens:
        rec.error = f"asked for {max_tokens} tokens, got {usage['completion_tokens']}"
    else:
        rec.output_tokens = usage["completion_tokens"]
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        rec.ok = True
    return rec


async def run_load(url: str, requests: int, concurrency: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                   seed: int, vocab: int | None, warmup: int, timeout: float, rolling_restarts: int = 0,
                   state_dir: str | None = None, progress=lambda msg: None, extra_body: dict | None = None) -> dict:
    async with client_session(url, concurrency + 2) as client:
        info = await server_info(client)
        need = prompt_len[1] + output_len[1]
        if info["max_model_len"] and need > info["max_model_len"]:
            raise ValueError(f"prompt up to {prompt_len[1]} + output up to {output_len[1]} tokens exceeds the worker's "
                             f"context length {info['max_model_len']}; lower --prompt-len or --output-len")
        if vocab is None:
            vocab = await discover_vocab(client, info["model"])
            progress(f"vocabulary: {vocab} ids (found by bisection)")
        fields = request_fields(info["model"], extra_body)
        work = make_requests(warmup + requests, prompt_len, output_len, vocab, seed)
        if warmup:
            progress(f"{warmup} warm-up request(s)")
            warm = await asyncio.gather(*(one_request(client, fields, p, m, time.perf_counter(), timeout)
                                          for p, m in work[:warmup]))
            bad = [w.error for w in warm if not w.ok]
            if bad:
                raise RuntimeError(f"warm-up failed: {bad[0]}")
        graphs_wait = await wait_for_graphs(client, progress)
        progress(f"{requests} requests, {concurrency} concurrent")
        steps_before = await engine_steps(client)
        records, wall, cpu = await closed_loop(client, fields, work[warmup:], concurrency, timeout)
        await asyncio.sleep(STEPS_SETTLE)
        result = summarize(records, wall, info | {"url": url, "vocab": vocab}, {
            "requests": requests, "concurrency": concurrency, "prompt_len": list(prompt_len),
            "output_len": list(output_len), "seed": seed, "warmup": warmup, "graphs_wait_s": graphs_wait,
            "extra_body": extra_body or {}}, cpu)
        result["engine_steps"] = steps_taken(steps_before, await engine_steps(client))
        if rolling_restarts:
            progress(f"the same {requests} requests again, during {rolling_restarts} rolling restart(s)")
            t0 = time.perf_counter()
            rounds = asyncio.create_task(asyncio.to_thread(restart_rounds, state_dir, rolling_restarts, t0))
            records, wall, cpu = await closed_loop(client, fields, work[warmup:], concurrency, timeout, rounds)
            result["under_restarts"] = figures(records, wall, cpu) | {"restarts": await rounds}
    return result


async def scrape(client: aiohttp.ClientSession) -> list:
    """The samples of the server's /metrics now (none where it has no /metrics, or it did not
    answer within the session's timeout)."""
    try:
        async with client.get("metrics", raise_for_status=True) as r:
            return metric_samples(await r.text())
    except (aiohttp.ClientError, TimeoutError):
        return []


def metric_samples(text: str) -> list:
    """The samples of a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def summed(samples: list, name: str) -> float:
    """A series' value summed over its label sets (workers, kinds): 0 where absent."""
    return sum(sample.value for sample in samples if sample.name == name)


async def engine_steps(client: aiohttp.ClientSession) -> dict[str, float] | None:
    """The worker's engine step totals now (summed over its workers), or None where its
    /metrics has none."""
    totals: dict[str, float] = {}
    for sample in await scrape(client):
        if sample.name in STEP_SERIES:
            key = STEP_SERIES[sample.name] + (f" {sample.labels['kind']}" if "kind" in sample.labels else "")
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals or None


async def wait_for_graphs(client: aiohttp.ClientSession, progress=lambda msg: None, timeout: float = GRAPHS_TIMEOUT,
                          poll: float = 0.5) -> float:
    """Wait until the workers have captured every CUDA graph bucket (/metrics' graphs
    pending at 0, or absent: another server, a CPU): a bucket's first step captures it
    (0.1-0.6 s on the H200) and an idle engine captures the rest one at a time, so that a
    run begun earlier would time a fresh worker's captures, not its serving. The seconds
    waited; RuntimeError past `timeout`."""
    t0, told = time.perf_counter(), False
    while (pending := summed(await scrape(client), GRAPHS_PENDING)) > 0:
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"the workers still had {pending:.0f} CUDA graph bucket(s) to capture after {timeout:.0f} s")
        if not told:
            progress(f"waiting for the workers to capture {pending:.0f} CUDA graph bucket(s)")
            told = True
        await asyncio.sleep(poll)
    return time.perf_counter() - t0


def steps_taken(before: dict | None, after: dict | None) -> dict | None:
    """What the run's steps were: each kind's count and mean ms, and the host's wait on
    the GPU as a share of the launched-ahead steps' time."""
    if before is None or after is None:
        return None
    gained = {k: after[k] - before.get(k, 0.0) for k in after}
    kinds = {k.split(" ", 1)[1] for k in gained if k.startswith("steps ")}
    out = {kind: {"steps": int(gained[f"steps {kind}"]), "seconds": gained.get(f"seconds {kind}", 0.0),
                  "ms_per_step": 1e3 * gained.get(f"seconds {kind}", 0.0) / gained[f"steps {kind}"]
                  if gained[f"steps {kind}"] else None} for kind in sorted(kinds)}
    ahead = out.get("decode_ahead", {}).get("seconds", 0.0)
    out["gpu_wait_s"] = gained.get("gpu_wait", 0.0)
    out["gpu_wait_share"] = out["gpu_wait_s"] / ahead if ahead else None
    return out


async def closed_loop(client: aiohttp.ClientSession, fields: dict, work: list, concurrency: int,
                      timeout: float, until: asyncio.Future | None = None) -> tuple[list[RequestRecord], float, float]:
    """`concurrency` clients, each sending its next request as soon as its previous one
    ended, until `work` is done (and, with `until`, over again until it is done too): the
    records, the wall time and the CPU time this process spent meanwhile."""
    queue = list(reversed(work))
    records: list[RequestRecord] = []
    t0, cpu0 = time.perf_counter(), time.process_time()

    async def client_loop():
        while queue or (until is not None and not until.done()):
            if not queue:
                queue.extend(reversed(work))
            prompt, max_tokens = queue.pop()
            records.append(await one_request(client, fields, prompt, max_tokens, t0, timeout))

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return records, time.perf_counter() - t0, time.process_time() - cpu0


def restart_rounds(state_dir: str, rounds: int, t0: float) -> list[dict]:
    """`preload restart` (every worker replaced, one at a time) `rounds` times in a row."""
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        r = preload("restart", "--state-dir", state_dir, timeout=RESTART_TIMEOUT)
        out.append({"started_s": start - t0, "seconds": time.perf_counter() - start, "ok": r.returncode == 0,
                    "output": (r.stdout + r.stderr).strip()[-300:]})
    return out


def summarize(records: list[RequestRecord], wall: float, server: dict, config: dict, client_cpu_s: float) -> dict:
    return {"bench": "serve", "server": server, "config": config,
            "machine": host_info() | {"loadavg_after": os.getloadavg()}, **figures(records, wall, client_cpu_s)}


def figures(records: list[RequestRecord], wall: float, client_cpu_s: float) -> dict:
    good = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    prompt_tokens = sum(r.prompt_tokens for r in good)
    return {
        "wall_s": wall,
        # The load generator's own CPU (one process, one event loop) over the wall time: near 1, it
        # was busy enough to read chunks late, and the latencies are partly its own.
        "client_cpu_share": client_cpu_s / wall if wall else None,
        "completed": len(good),
        "failed": len(records) - len(good),
        "errors": sorted({r.error for r in records if r.error})[:10],
        "throughput": {
            "requests_per_s": len(good) / wall if wall else None,
            "output_tokens_per_s": out_tokens / wall if wall else None,
            "total_tokens_per_s": (out_tokens + prompt_tokens) / wall if wall else None,
            "prompt_tokens": prompt_tokens,
            "prompt_tokens_cached": sum(r.cached_tokens for r in good),
            "output_tokens": out_tokens,
        },
        "ttft_s": quantiles((r.ttft for r in good), PERCENTILES),
        "itl_s": quantiles((g for r in good for g in r.chunk_gaps), PERCENTILES),
        "tpot_s": quantiles((r.tpot for r in good), PERCENTILES),
        "latency_s": quantiles((r.latency for r in good), PERCENTILES),
        "requests": [asdict(r) | {"tpot": r.tpot} for r in records],
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def format_table(result: dict) -> str:
    s, c, m = result["server"], result["config"], result["machine"]
    lines = [
        f"preload bench serve: {s['url']} model {s['model']} (context {s['max_model_len']}, vocab {s['vocab']})",
        f"{c['requests']} requests, {c['concurrency']} concurrent, prompt {c['prompt_len'][0]}-{c['prompt_len'][1]} "
        f"tokens, output {c['output_len'][0]}-{c['output_len'][1]} tokens (ignore_eos), seed {c['seed']}; "
        f"client on {m['hostname']} ({m['cpus_usable']} CPUs)"
        + (f"; waited {c['graphs_wait_s']:.1f} s for the workers' CUDA graphs" if c.get("graphs_wait_s", 0) >= 1 else ""),
        *run_lines(result),
    ]
    under = result.get("under_restarts")
    if under:
        took = [r["seconds"] for r in under["restarts"]]
        failed = sum(not r["ok"] for r in under["restarts"])
        lines += ["", f"the same requests again, during {len(took)} `preload restart` round(s) of "
                      f"{min(took):.2f}-{max(took):.2f} s ({failed} failed):", *run_lines(under)]
    return "\n".join(lines)


def run_lines(run: dict) -> list[str]:
    """One run's throughput and latencies."""
    t = run["throughput"]
    cached = 100 * t.get("prompt_tokens_cached", 0) / max(t["prompt_tokens"], 1)
    lines = [
        f"completed {run['completed']}, failed {run['failed']} in {run['wall_s']:.2f} s",
        f"throughput: {t['requests_per_s']:.2f} req/s, {t['output_tokens_per_s']:.1f} output tok/s, "
        f"{t['total_tokens_per_s']:.1f} total tok/s",
        # (a run that repeats an earlier one's --seed on the same server finds its prompts cached, and is faster)
        f"prompt tokens found in the prefix cache: {cached:.1f}%",
        "",
        f"{'latency (ms)':<22}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}{'n':>8}",
    ]
    for key, label in (("ttft_s", "time to first token"), ("itl_s", "inter-token latency"),
                       ("tpot_s", "time per output token"), ("latency_s", "request latency")):
        p = run[key] or dict.fromkeys(("p50", "p90", "p99", "mean"), None) | {"n": 0}
        lines.append(f"{label:<22}{_ms(p['p50']):>10}{_ms(p['p90']):>10}{_ms(p['p99']):>10}{_ms(p['mean']):>10}{p['n']:>8}")
    steps = run.get("engine_steps")
    if steps:
        kinds = [k for k in KINDS if k in steps]
        lines += ["", "engine steps: " + ", ".join(
            f"{k} {steps[k]['steps']} x {_ms(steps[k]['ms_per_step'] and steps[k]['ms_per_step'] / 1e3)} ms"
            for k in kinds)]
        if steps["gpu_wait_share"] is not None:
            lines.append(f"decode_ahead steps waited on the GPU {100 * steps['gpu_wait_share']:.0f}% of their time "
                         "(near 100%: bound by the GPU; far below: by the host's work between steps)")
    share = run.get("client_cpu_share")
    if share is not None:
        lines.append(f"the client (this process) was busy {100 * share:.0f}% of the run"
                     + (": near a whole core, its own lag is in the latencies above" if share > CLIENT_BUSY else ""))
    if run["errors"]:
        lines += ["", "errors:"] + [f"  {e}" for e in run["errors"]]
    return lines
