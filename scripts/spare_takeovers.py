"""Warm-spare take-overs only (the first kind of `preload bench restart`, without its
cold starts and other kinds): a daemon with one worker and one spare, the worker killed
N times, each take-over's stages from /status, then the workers' log lines (KV cache
made or mapped again, graphs captured). A quick check on a GPU machine:

    python3 scripts/spare_takeovers.py /tmp/v2-lite 5 cuda:0
"""

import json
import sys
from pathlib import Path

from preload.bench.driver import free_port, running_daemon
from preload.bench.restart import DAEMON_FLAGS, one_restart

WORDS = ("KV cache", "ready in", "captured", "serving slot")

if __name__ == "__main__":
    model, times, device = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    with running_daemon(model, "--device", device, "--workers", 1, *DAEMON_FLAGS["sigkill-spare"], api_port=free_port()) as d:
        for _ in range(times):
            r = one_restart(d, "sigkill-spare")
            stages = {k: round(v, 3) if isinstance(v, float) else v for k, v in r["breakdown"].items()}
            print(json.dumps({"seconds": round(r["seconds"], 3)} | stages))
        for f in sorted(d.state_dir.glob("*.log")):
            print(f.name, *[line for line in f.read_text().splitlines() if any(w in line for w in WORDS)][-12:], sep="\n  ")
