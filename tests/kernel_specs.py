"""Specialization JSONs of a real kernel, as Triton's JIT hands them to its hooks, for the
tests of kernels compiled ahead (kernels/ahead.py, `preload kernels compile`)."""

from __future__ import annotations

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import serialize_specialization_data

from preload.kernels import fused_norm

H100 = GPUTarget("cuda", 90, 32)
RMS_NORM = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16", "D": "i32",
            "eps": "fp32", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_s": "i32",
            "ADD": "constexpr", "BLOCK_D": "constexpr"}
ALIGNED = [["tt.divisibility", 16]]
CASES = ((False, 2048), (True, 2048), (True, 512))


def rms_norm_spec(add: bool, block_d: int) -> tuple:
    """The JSON the JIT hands its hooks for this specialization (Triton's own serializer),
    with the source and options the JIT compiles."""
    constants = {(11,): add, (12,): block_d}
    attrs = {(i,): ALIGNED for i in range(5)}
    options = make_backend(H100).parse_options({"num_warps": 4})
    name = f"{fused_norm._rms_norm.fn.__module__}.{fused_norm._rms_norm.fn.__qualname__}"
    spec = serialize_specialization_data(name, RMS_NORM, constants, attrs, options, "key", H100)
    return spec, ASTSource(fused_norm._rms_norm, RMS_NORM, constants, attrs), options
