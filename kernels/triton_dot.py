"""Dtypes for Triton kernels: torch's as Triton's (TRITON_DTYPES), and the dtype a
kernel's dot products take its tiles in: the activations' own, except in Triton's CPU
interpreter (the tests' way to run the kernels without a GPU), which computes bf16 dot
products wrongly and is given float32 tiles instead."""

from __future__ import annotations

import os

import torch
import triton.language as tl

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
                 torch.float8_e4m3fn: tl.float8e4nv}


def dot_dtype(dtype: torch.dtype):
    return tl.float32 if INTERPRETING else TRITON_DTYPES[dtype]
