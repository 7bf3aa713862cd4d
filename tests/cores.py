"""Engine cores as real processes for the front's tests: the bundled model in float32 on
the CPU, serving a slot's channel (worker/core.py) as a supervised core does once it has
its slot; what the supervisor adds (forking, slots, spares) is left out."""

from __future__ import annotations

import json
import subprocess
import sys

CORE = """
import json, os, sys
from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
from preload.worker.core import Core, hello_of
address, takeover, engine, poison = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
llm = LLM(BUNDLED_MODEL, dtype="float32", device="cpu", engine=EngineOptions(**engine))
core = Core(llm, address, hello_of(llm, "tiny", takeover), drain_timeout=5.0)
step = core._step

def poisoned():  # a step with the poison token in a prompt kills the process, as a fault of the engine would
    if any(poison in s.prompt for s in core.seqs.values()):
        os._exit(70)
    step()

core._step = poisoned
print("serving", flush=True)
core.run()
core.close()
"""


def start_core(address: str, takeover: str = "first", poison: int = -1, **engine) -> subprocess.Popen:
    """A core process on `address`, once it serves (it has said hello). `poison`: a token
    that kills it as soon as a request whose prompt holds it is in a step."""
    proc = subprocess.Popen([sys.executable, "-c", CORE, address, takeover, json.dumps(engine), str(poison)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.strip() != "serving":
        proc.kill()
        raise RuntimeError(f"the core did not start: {line!r}, exit {proc.wait()}")
    return proc
