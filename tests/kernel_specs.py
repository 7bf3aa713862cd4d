"""Specialization JSONs of a real kernel, as Triton's JIT hands them to its hooks, for the
tests of kernels compiled ahead (kernels/ahead.py, `preload kernels compile`)."""

from __future__ import annotations

import triton.language as tl
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


# The prefill attention's kernel (mla_prefill._prefill_chunk) at V2-Lite's shapes and the
# GPU's tiles: its keys and values come as TMA descriptors, typed "tensordesc<...>".
PREFILL_ATTENTION = {"q_nope_ptr": "*bf16", "q_pe_ptr": "*bf16", "kn_desc": "tensordesc<bf16[64, 128]>",
                     "kp_desc": "tensordesc<bf16[64, 64]>", "v_desc": "tensordesc<bf16[64, 128]>",
                     "q_starts_ptr": "*i64", "kv_starts_ptr": "*i64", "lens_ptr": "*i64", "m_ptr": "*fp32",
                     "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16", "lo": "i32", "hi": "i32",
                     "qk_scale": "fp32"} | {
    s: "i32" for s in ("stride_nt", "stride_nh", "stride_pt", "stride_ph", "stride_st", "stride_at", "stride_ah",
                       "stride_ot", "stride_oh")}
PREFILL_ATTENTION_CONSTEXPRS = dict(DN=128, DR=64, DV=128, PN=128, PR=64, PV=128, HEAD_COLS=256, V_COL=128,
                                    BLOCK_M=128, BLOCK_N=64)  # (and FINAL, DOT: each use its own)


def prefill_attention_spec() -> str:
    """The JSON of the prefill attention's kernel (PREFILL_ATTENTION), as the JIT hands it
    to its hooks: a list carries the descriptors' types as strings."""
    from preload.kernels import mla_prefill

    fn = mla_prefill._prefill_chunk
    signature = {n: PREFILL_ATTENTION.get(n, "constexpr") for n in fn.arg_names}
    values = PREFILL_ATTENTION_CONSTEXPRS | dict(FINAL=True, DOT=tl.bfloat16)
    constants = {(fn.arg_names.index(k),): v for k, v in values.items()}
    attrs = {(fn.arg_names.index(n),): ALIGNED for n, t in PREFILL_ATTENTION.items() if t.startswith("*")}
    options = make_backend(H100).parse_options({"num_warps": 8, "num_stages": 3})
    return serialize_specialization_data(f"{fn.fn.__module__}.{fn.fn.__qualname__}", signature, constants, attrs,
                                         options, "key", H100)
