"""Where a worker's start goes once its imports are done (the zygote did them): attaching
to the daemon's weights, building the model and engine, loading the kernels and capturing
the largest decode graph (a lazy start's), and the warm-up step, as worker/serve.py does
them, here in one process under cProfile.

    python3 scripts/probe_worker_start.py STATE_DIR [--profile]

Triton, the kernel modules and Triton's hash of itself come first, unprofiled, as a zygote
does them before it forks (kernels.triton_import_steps).
Run it once to fill the kernel cache (the daemon's TRITON_CACHE_DIR, if set, is not this
process's: set it alike), then again with --profile: a worker's start with its kernels
compiled. Prints the phases' seconds, then the profile's top functions (cumulative, then
own time); with $OUT set, writes worker-start.prof there too.
"""

import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import torch

from preload.kernels import triton_import_steps
from preload.options import EngineOptions
from preload.worker.llm import LLM
from preload.worker.serve import WARM_UP_KV_BYTES, WARM_UP_PROMPT


def start(state_dir: str) -> dict:
    t0 = time.monotonic()
    llm = LLM(state_dir=state_dir, engine=EngineOptions(kv_cache_memory=WARM_UP_KV_BYTES), lazy_graphs=True)
    t1 = time.monotonic()
    llm.generate([WARM_UP_PROMPT], max_tokens=1)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t2 = time.monotonic()
    llm.close()
    return {"attach, build, capture the largest graph": round(t1 - t0, 3), "warm-up step": round(t2 - t1, 3)}


def main(state_dir: str, profile: bool) -> None:
    for step in triton_import_steps():  # what the zygote did before it forked the worker
        step()
    if not profile:
        print(start(state_dir))
        return
    prof = cProfile.Profile()
    phases = prof.runcall(start, state_dir)
    print(phases)
    stats = pstats.Stats(prof).strip_dirs()
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    if os.environ.get("OUT"):
        prof.dump_stats(str(Path(os.environ["OUT"], "worker-start.prof")))


if __name__ == "__main__":
    main(sys.argv[1], "--profile" in sys.argv[2:])
