"""Where a forked worker's start-up time goes (a diagnostic, not a benchmark).

Usage: python3 scripts/startup_profile.py STATE_DIR
Imports what the zygote imports, then forks children that attach to the daemon on
STATE_DIR and time each stage; one child runs its first token under cProfile.
"""

import cProfile
import json
import os
import pstats
import signal
import sys
import time

t = time.perf_counter()
import fastapi  # noqa: F401,E402
import torch  # noqa: E402
import uvicorn  # noqa: F401,E402

import preload.worker.serve  # noqa: F401,E402
from preload.worker.llm import LLM  # noqa: E402

print(f"imports {time.perf_counter() - t:.3f} s", flush=True)
state_dir = sys.argv[1]


def in_child(body) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            sys.stdout.flush()
            os._exit(0)
    os.waitpid(pid, 0)


def stages(profile: bool) -> None:
    t0 = time.perf_counter()
    marks = {}

    def mark(k):
        marks[k] = round(time.perf_counter() - t0, 4)

    torch.cuda.init()
    torch.empty(1, device="cuda")
    mark("cuda_context")
    llm = LLM(state_dir=state_dir)
    mark("llm_attached")
    pr = cProfile.Profile()
    if profile:
        pr.enable()
    llm.generate([[0]], max_tokens=1)
    pr.disable()
    mark("first_token")
    llm.generate([[0]], max_tokens=1)
    mark("second_token")
    print(json.dumps(marks), flush=True)
    if profile:
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)


def primitives() -> None:
    t0 = time.perf_counter()
    marks = {}

    def mark(k):
        torch.cuda.synchronize()
        marks[k] = round(time.perf_counter() - t0, 4)

    x = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    mark("context+ones")
    y = x @ x
    mark("first_matmul_bf16")
    y = x.float() @ x.float()
    mark("first_matmul_f32")
    y = torch.softmax(y, -1)
    mark("softmax")
    y.topk(4, -1)
    mark("topk")
    big = torch.empty(80 << 30, dtype=torch.uint8, device="cuda")
    mark("empty_80GiB")
    big.zero_()
    mark("zero_80GiB")
    print(json.dumps(marks), flush=True)


def kill_to_reap() -> None:
    """How long a SIGKILLed worker takes to die (driver context teardown included)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        llm = LLM(state_dir=state_dir)
        llm.generate([[0]], max_tokens=1)
        os.write(w, b"x")
        time.sleep(60)
        os._exit(0)
    os.read(r, 1)
    t = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print(f"kill_to_reap {time.perf_counter() - t:.4f} s", flush=True)


for _ in range(2):
    in_child(lambda: stages(False))
in_child(lambda: stages(True))
in_child(primitives)
for _ in range(2):
    kill_to_reap()
