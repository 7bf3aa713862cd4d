"""The NaN/Inf check on a weight's raw bytes, with numpy alone (no torch: the loader
that needs no torch runs it too, chunk by chunk, as the bytes are hashed).

A float is NaN or infinite exactly when all its exponent bits are set (e4m3fn has no
infinity: its NaN is every exponent and mantissa bit set too), that is when its bits
without the sign are at least a limit L. Read as a signed integer, a positive value is
non-finite when it is >= L; read as unsigned, a negative one is non-finite when it is >=
L with the sign bit set, the top of the unsigned range. So two max reductions over the
same bytes decide it, and neither writes memory. Masking the sign off first (AND, then
max) wrote a temporary as large as the chunk: on the 2-core CPU machine the two reductions
are 10-30% faster (0.15-0.25 s -> 0.13-0.18 s over V2-Lite-mini's 1.2 GB, three runs); on
the H200 host, 16 threads at once, both run at the memory's speed, as fast as BLAKE3
(scripts/probe_chunks.py, results/probes/probe-chunks-*.json).
"""

from __future__ import annotations

import numpy as np

# torch dtype name -> (signed view, unsigned view, smallest non-finite pattern without the sign)
_NONFINITE = {
    "float64": (np.int64, np.uint64, 0x7FF0_0000_0000_0000),
    "float32": (np.int32, np.uint32, 0x7F80_0000),
    "float16": (np.int16, np.uint16, 0x7C00),
    "bfloat16": (np.int16, np.uint16, 0x7F80),
    "float8_e4m3fn": (np.int8, np.uint8, 0x7F),
    "float8_e5m2": (np.int8, np.uint8, 0x7C),
}


def nonfinite_limit(dtype: str) -> tuple[int, int] | None:
    """(bytes per value, smallest non-finite pattern without the sign) of float `dtype`;
    None for a dtype that has no NaN or Inf (integers). ipc/finite_device.py's kernel
    checks by it."""
    if dtype not in _NONFINITE:
        return None
    signed, _, limit = _NONFINITE[dtype]
    return np.dtype(signed).itemsize, limit


def all_finite(dtype: str, data) -> bool:
    """No NaN or Inf among the values of `dtype` (a torch dtype name) in the buffer `data`;
    other dtypes (integers) are finite by definition."""
    if dtype not in _NONFINITE:
        return True
    signed, unsigned, limit = _NONFINITE[dtype]
    positive = np.frombuffer(data, dtype=signed)
    if positive.size == 0:
        return True
    sign = 1 << (8 * positive.itemsize - 1)
    return int(positive.max()) < limit and int(np.frombuffer(data, dtype=unsigned).max()) < (limit | sign)
