"""The naive restart `bench cold --transformers` compares with: a fresh interpreter
that imports transformers and loads the checkpoint's files with `from_pretrained` (bf16).

    python -m preload.bench.transformers_load MODEL_DIR DEVICE

prints one JSON line: the seconds its imports took, and `from_pretrained` (to the device).
"""

from __future__ import annotations

import json
import sys
import time


def main(model: str, device: str) -> dict:
    t0 = time.perf_counter()
    import torch
    import transformers

    t1 = time.perf_counter()
    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    # device_map needs accelerate on CPU, where the weights land on the CPU anyway
    placement = {"device_map": device} if device != "cpu" else {}
    transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, **placement)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"import_s": t1 - t0, "from_pretrained_s": time.perf_counter() - t1}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
