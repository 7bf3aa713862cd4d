"""The NaN/Inf check on a weight's raw bytes, with numpy alone (no torch: the loader
that needs no torch runs it too, chunk by chunk, as the bytes are hashed).

A float is NaN or infinite exactly when all its exponent bits are set; with the sign
bit cleared that is "magnitude bits >= the exponent mask", so one AND and one max over
the chunk decide it (e4m3fn has no infinity: its NaN is every exponent and mantissa bit set).
"""

from __future__ import annotations

import numpy as np

# torch dtype name -> (unsigned view, bits without the sign, smallest non-finite pattern)
_NONFINITE = {
    "float64": (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    "float32": (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
    "float16": (np.uint16, 0x7FFF, 0x7C00),
    "bfloat16": (np.uint16, 0x7FFF, 0x7F80),
    "float8_e4m3fn": (np.uint8, 0x7F, 0x7F),
    "float8_e5m2": (np.uint8, 0x7F, 0x7C),
}


def all_finite(dtype: str, data) -> bool:
    """No NaN or Inf among the values of `dtype` (a torch dtype name) in the buffer `data`;
    other dtypes (integers) are finite by definition."""
    if dtype not in _NONFINITE:
        return True
    view, magnitude, limit = _NONFINITE[dtype]
    values = np.frombuffer(data, dtype=view)
    if values.size == 0:
        return True
    return int(np.bitwise_and(values, view(magnitude)).max()) < limit
