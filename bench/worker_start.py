"""A worker's start, stage by stage, in this fresh interpreter attached to a running
daemon: what the zygote's imports save a forked worker, and what every worker still
pays (its CUDA context, attaching, building the model's views, its KV cache, its first
token). The daemon's /status says how long a whole start took; this says where it goes.

    python -m preload.bench.worker_start STATE_DIR

prints one JSON line of seconds per stage (`bench restart` runs it).
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main(state_dir: str) -> dict:
    t = time.perf_counter()
    import fastapi  # noqa: F401 - what the zygote imports
    import torch
    import uvicorn  # noqa: F401

    import preload.worker.serve  # noqa: F401
    from preload.ipc.client import DaemonClient
    from preload.options import CPU_KV_CACHE_BYTES, EngineOptions
    from preload.worker.attach import attach
    from preload.worker.engine.engine import Engine
    from preload.worker.llm import LLM
    from preload.worker.model.deepseek import Transformer

    out = {"imports_s": time.perf_counter() - t}
    with DaemonClient(state_dir) as client:
        device = torch.device(client.request("status")["status"]["device"])
    if device.type == "cuda":
        t = time.perf_counter()
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
        out["cuda_context_s"] = time.perf_counter() - t

    t = time.perf_counter()
    attach(state_dir).close()
    out["attach_s"] = time.perf_counter() - t
    t = time.perf_counter()
    llm = LLM(state_dir=state_dir)  # attach, model views and an engine with its KV cache
    out["llm_total_s"] = time.perf_counter() - t
    t = time.perf_counter()
    Transformer(llm.config, llm.attached)
    out["model_views_s"] = time.perf_counter() - t

    # The CPU's auto budget on any device: on a GPU the daemon's own worker holds its auto share already.
    engine = EngineOptions(kv_cache_memory=CPU_KV_CACHE_BYTES)
    kv = []
    for _ in range(3):
        t = time.perf_counter()
        Engine(llm.model, llm.tokenizer, engine, llm.device)
        kv.append(time.perf_counter() - t)
    out |= {"engine_kv_cache_s": statistics.median(kv), "kv_cache_bytes": engine.kv_cache_memory}
    for stage in ("first_token_s", "second_token_s"):
        t = time.perf_counter()
        llm.generate([[0]], max_tokens=1)
        out[stage] = time.perf_counter() - t
    llm.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
