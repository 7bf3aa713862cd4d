"""Failover: what clients see while a slot's engine core is killed again and again.

A daemon with one worker (`--spare-workers` as given: a warm spare takes each killed
core's slot, or the zygote forks a new one) serves `clients` closed-loop clients, half
of them streaming, each sending greedy completions of `max_tokens` tokens for prompts
drawn from a small set, whose uninterrupted outputs are read first. Meanwhile the core
is SIGKILLed `kills` times, each once the slot's new core is ready again and every
client has had an answer since the last kill (so that each kill meets requests of its
own: a request that meets several is taken for a poison pill). The front holds the
clients and hands the requests to the next core (worker/front.py).

Before each kill the bench waits for `spares` warm spares (standby), so that each kill
measures a warm spare's takeover (the supervisor's replacement of a cold one is `bench
restart`'s), and before the first for two answers from every client.

What is reported: requests answered and failed (not 200, a broken stream, fewer tokens
than asked), outputs that differ from the uninterrupted ones (greedy: there should be
none; beside them, those of the requests no kill met, the floor on a GPU: `figures`),
per kill the pause a stream in flight saw: the longest gap between two of its chunks
that spans the kill, less the median gap of the run (the added latency), p50/p90, and
the takeover: from the kill until `/status` shows the slot's next core ready.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from preload.bench.driver import Daemon, free_port, running_daemon, wait_for
from preload.bench.gpu import Gpu
from preload.bench.results import begin, finish, quantiles, row
from preload.bench.serve import metric_samples, summed

PROMPTS = 16
VOCAB_SAFE = 1000  # prompt ids drawn below this: inside any of our models' vocabularies


@dataclass
class Outcome:
    stream: bool
    prompt: int  # index into the prompts
    ok: bool = False
    error: str | None = None
    text: str = ""
    chunks: list[float] = field(default_factory=list)  # arrival times (perf_counter) of a stream's chunks
    sent: float = field(default_factory=time.perf_counter)
    done: float = 0.0


async def complete(client: httpx.AsyncClient, prompt: list[int], index: int, max_tokens: int, stream: bool) -> Outcome:
    out = Outcome(stream, index)
    try:
        return await answer(client, prompt, max_tokens, out)
    finally:
        out.done = time.perf_counter()


async def answer(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, out: Outcome) -> Outcome:
    stream = out.stream
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    try:
        if not stream:
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            data = r.json()
            out.text, tokens = data["choices"][0]["text"], data["usage"]["completion_tokens"]
        else:
            tokens, done = 0, False
            async with client.stream("POST", "/v1/completions", json=body | {"stream_options": {"include_usage": True}}) as r:
                if r.status_code != 200:
                    out.error = f"HTTP {r.status_code}"
                    return out
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices"):
                        out.text += chunk["choices"][0]["text"]
                        out.chunks.append(time.perf_counter())
            if not done:
                out.error = "stream ended without [DONE]"
                return out
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.ok = tokens == max_tokens
    if not out.ok:
        out.error = f"asked for {max_tokens} tokens, got {tokens}"
    return out


def core_pid(d: Daemon) -> int | None:
    [w] = d.status()["workers"]
    return w["pid"] if w["state"] == "ready" else None


def spares_ready(d: Daemon, spares: int) -> bool:
    return sum(s["state"] == "standby" for s in d.status()["spares"]) >= spares


async def run_case(d: Daemon, clients: int, kills: int, max_tokens: int, spares: int, seed: int, progress) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB_SAFE) for _ in range(rng.randint(8, 64))] for _ in range(PROMPTS)]
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{d.api_port}", timeout=120, limits=limits) as client:
        want = [o.text for o in await asyncio.gather(*(complete(client, p, i, max_tokens, False)
                                                       for i, p in enumerate(prompts)))]
        drafted_before = await draft_counts(client)
        outcomes: list[Outcome] = []
        answers = [0] * clients  # each client's, so far
        stop = False

        async def one_client(c: int) -> None:
            k = c
            while not stop:
                i = (k * 7 + c) % PROMPTS
                outcomes.append(await complete(client, prompts[i], i, max_tokens, stream=c % 2 == 0))
                answers[c] += 1
                k += 1

        async def every_client_answered_since(counts: list[int]) -> None:
            while any(a <= b for a, b in zip(answers, counts)):
                await asyncio.sleep(0.01)

        tasks = [asyncio.ensure_future(one_client(c)) for c in range(clients)]
        killed_at, takeover, counts = [], [], [1] * clients
        for k in range(kills):
            pid = await asyncio.to_thread(wait_for, lambda: core_pid(d), 120, 0.02)
            # a warm spare to take over (a kill before it is warm measures a cold fork); and
            # the requests the last kill met are done: each kill meets requests of its own
            # (before the first: two answers each, the run's outputs with no kill to compare)
            await asyncio.to_thread(wait_for, lambda: spares_ready(d, spares), 300, 0.05)
            await asyncio.wait_for(every_client_answered_since(counts), 300)
            await asyncio.sleep(rng.uniform(0.05, 0.3))  # (mid-prefill, mid-stream: wherever it falls)
            counts = list(answers)
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.perf_counter())
            progress(f"{clients} clients: kill {k + 1}/{kills} (pid {pid})")
            await asyncio.to_thread(wait_for, lambda: core_pid(d) not in (None, pid), 120, 0.01)
            takeover.append(time.perf_counter() - killed_at[-1])
        await asyncio.sleep(0.5)
        stop = True
        await asyncio.gather(*tasks)
        drafts = {k: v - drafted_before[k] for k, v in (await draft_counts(client)).items()}
    return figures(outcomes, want, killed_at) | {"clients": clients, "kills": kills, "max_tokens": max_tokens,
                                                 "takeover_s": quantiles(takeover, (50, 90))} | drafts


async def draft_counts(client: httpx.AsyncClient) -> dict[str, float]:
    """The draft tokens made and accepted so far, by the worker's /metrics (its front's
    counters: they outlive the cores killed)."""
    try:
        r = await client.get("/metrics")
        r.raise_for_status()
        samples = metric_samples(r.text)
    except httpx.HTTPError:
        samples = []
    return {f"{name}_tokens": summed(samples, f"preload_spec_decode_num_{name}_tokens_total")
            for name in ("draft", "accepted")}


def figures(outcomes: list[Outcome], want: list[str], killed_at: list[float]) -> dict:
    """`outputs_differ` counts every answer unlike the uninterrupted one; `differ_met_no_kill`
    those of requests done before the first kill or sent after the last: on a GPU, greedy
    outputs also change with the batch they ran in (its kernels are not batch-invariant,
    and a random-weight checkpoint's near-equal logits flip on such noise), so that count
    is the floor the kills' should be read against."""
    failed = [o for o in outcomes if not o.ok]
    differ = [o for o in outcomes if o.ok and o.text != want[o.prompt]]
    calm = [o for o in outcomes if o.ok and killed_at and (o.done < killed_at[0] or o.sent > killed_at[-1])]
    gaps = [b - a for o in outcomes for a, b in zip(o.chunks, o.chunks[1:])]
    typical = statistics.median(gaps) if gaps else 0.0
    pauses = []
    for t in killed_at:
        spanning = [b - a for o in outcomes for a, b in zip(o.chunks, o.chunks[1:]) if a <= t < b]
        if spanning:
            pauses.append(max(spanning) - typical)
    return {"requests": len(outcomes), "failed": len(failed), "errors": sorted({o.error for o in failed})[:10],
            "outputs_differ": len(differ), "met_no_kill": len(calm),
            "differ_met_no_kill": sum(o.text != want[o.prompt] for o in calm), "streams": sum(o.stream for o in outcomes),
            "median_chunk_gap_s": typical, "added_latency_s": quantiles(pauses, (50, 90)),
            "kills_seen_by_a_stream": len(pauses)}


def run_failover(model: Path, device: str, clients: list[int], kills: int, max_tokens: int, spares: int,
                 speculative_tokens: int, progress) -> dict:
    """`speculative_tokens`: with MTP drafts (the model's MTP layer), so that kills land mid-drafting too."""
    t0 = time.perf_counter()
    result = begin("failover", device, Gpu.for_device(device)) | {
        "model": str(model), "spare_workers": spares, "runs": [], "speculative_tokens": speculative_tokens}
    spec = ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": speculative_tokens})
            ) if speculative_tokens else ()
    with running_daemon(model, "--device", device, "--workers", 1, "--spare-workers", spares, "--dtype",
                        "float32" if device == "cpu" else "auto", *spec, api_port=free_port()) as d:
        for n in clients:
            result["runs"].append(asyncio.run(run_case(d, n, kills, max_tokens, spares, seed=n, progress=progress)))
    return finish(result, t0)


def format_table(result: dict) -> str:
    m = result["machine"]
    drafts = f", {result['speculative_tokens']} MTP drafts a step" if result.get("speculative_tokens") else ""
    lines = [f"preload bench failover: {result['model']}, one worker, {result['spare_workers']} spare(s){drafts}, on "
             f"{m.get('cuda_device') or m.get('cpu_model')}; {result['wall_s']:.0f} s", ""]
    widths = (8, 6, 9, 7, 8, 14, 9, 10, 10, 13)
    lines.append(row(("clients", "kills", "requests", "failed", "differ", "no kill: differ", "streams", "added p50",
                      "added p90", "takeover p50"), widths))
    for r in result["runs"]:
        a, t = r["added_latency_s"] or {}, r.get("takeover_s") or {}
        lines.append(row((r["clients"], r["kills"], r["requests"], r["failed"], r["outputs_differ"],
                          f"{r.get('differ_met_no_kill', '-')} of {r.get('met_no_kill', '-')}", r["streams"],
                          f"{a.get('p50', float('nan')):.3f}", f"{a.get('p90', float('nan')):.3f}",
                          f"{t.get('p50', float('nan')):.3f}"), widths))
        if result.get("speculative_tokens") and "draft_tokens" in r:
            lines.append(f"  {r['clients']} clients: {r['draft_tokens']:.0f} tokens drafted, {r['accepted_tokens']:.0f} accepted")
        if r["errors"]:
            lines.append(f"  errors: {r['errors']}")
    return "\n".join(lines)
