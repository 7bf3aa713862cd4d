"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU, to read what the
compiler made of it: whether a loop's loads are copied ahead asynchronously (pipelined),
how wide its stores are. In a process of its own: the tests run Triton's interpreter, whose
kernels cannot be compiled. Every pointer and i32 argument is taken as 16-divisible, as the
launcher specializes them for aligned tensors and strides."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

COMPILE = """
import json, sys
import triton, triton.language as tl
from importlib import import_module
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constexprs, warps, stages = json.loads(sys.argv[1])
kernel = getattr(import_module(module), name)
constexprs = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v for k, v in constexprs.items()}
sig = {n: signature.get(n, "constexpr") for n in kernel.arg_names}
aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
           if sig[n].startswith("*") or sig[n] == "i32"}
try:
    asm = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=aligned),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}).asm
except (ImportError, RuntimeError) as e:
    print(json.dumps({"skip": f"{type(e).__name__}: {e}"[:300]}))
else:
    print(json.dumps({k: asm[k] for k in ("ttgir", "ptx")}))
"""


def compile_for_hopper(module: str, kernel: str, signature: dict[str, str], constexprs: dict, num_warps: int = 4,
                       num_stages: int = 3) -> dict[str, str]:
    """`module.kernel`'s TTGIR and PTX for sm_90: `signature` types each runtime argument
    ("*bf16", "i32", ...), `constexprs` gives the rest (a dtype as "tl.bfloat16"); skipped
    where Triton cannot compile for NVIDIA here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    r = subprocess.run([sys.executable, "-c", COMPILE, json.dumps([module, kernel, signature, constexprs, num_warps,
                                                                     num_stages])],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"Triton cannot compile for sm_90 here: {out['skip']}")
    return out


def count(text: str, op: str) -> int:
    return len(re.findall(re.escape(op), text))
