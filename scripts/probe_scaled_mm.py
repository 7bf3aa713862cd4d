"""Whether torch's scaled matmul takes DeepSeek's fp8 block scales on this GPU (activations
per row and 128 columns, weights per 128 x 128 block: cuBLASLt's block-scaled fp8 on
Hopper), how exact it is, and how fast at V2-Lite's and V3's dense shapes for a prefill's
rows, against our Triton fp8 linear (kernels/fp8_linear.py without it) and a bf16 cuBLAS GEMM of the same
shape. A probe, not product: its output decides fp8_linear's path for many rows.

    PYTHONPATH=$PWD/tests:$PWD/scripts python3 scripts/probe_scaled_mm.py > probe.json
"""

import json
import sys

import torch
import torch.nn.functional as F

from sweep_kernels import timed

from preload.kernels.fp8 import FP8, dequantize_block, quantize_block
from preload.kernels.fp8_act import quantize_groups
import preload.kernels.fp8_linear as fl
from preload.kernels.quant import Fp8Weight

dev = "cuda"
# (name, N, K): attention's and the shared experts' matrices
SHAPES = {"v2-lite": [("q", 3072, 2048), ("kv_a", 576, 2048), ("kv_b", 4096, 512), ("o", 2048, 2048),
                      ("shared_gate", 2816, 2048), ("shared_down", 2048, 2816)],
          "v3": [("q_a", 1536, 7168), ("q_b", 24576, 1536), ("kv_a", 576, 7168), ("o", 7168, 16384),
                 ("shared_gate", 2048, 7168), ("shared_down", 7168, 2048)]}


def block_scaled(x_q, x_s, w: Fp8Weight, out_dtype=torch.bfloat16):
    """x_q [M, K] e4m3 with x_s [M, K/128] float32 (any layout) times W^T through F.scaled_mm."""
    from torch.nn.functional import ScalingType, SwizzleType

    a_s = x_s.t().contiguous().t()  # (M, K/128) with stride (1, M): cuBLASLt's 1x128 layout
    w_s = F.pad(w.scale_inv, (0, -w.scale_inv.shape[1] % 4), value=1.0)  # (K blocks padded to a multiple of 4)
    return F.scaled_mm(x_q, w.q.t(), a_s, ScalingType.BlockWise1x128, w_s.t(), ScalingType.BlockWise128x128,
                       SwizzleType.NO_SWIZZLE, SwizzleType.NO_SWIZZLE, None, out_dtype)


def legacy_scaled(x_q, x_s, w: Fp8Weight, out_dtype=torch.bfloat16):
    """The same through torch._scaled_mm (its older entry point)."""
    a_s = x_s.t().contiguous().t()
    return torch._scaled_mm(x_q, w.q.t(), a_s, w.scale_inv.t(), out_dtype=out_dtype)


def triton_linear(x, w):
    """fp8_linear as it is without cuBLASLt's block scales: the Triton grouped GEMM."""
    real, fl.block_scaled_gemm = fl.block_scaled_gemm, lambda device: False
    try:
        return fl.fp8_linear(x, w)
    finally:
        fl.block_scaled_gemm = real


def case(n, k, m):
    torch.manual_seed(0)
    w = torch.randn(n, k, device=dev) * 0.02
    q, s = quantize_block(w)
    fw = Fp8Weight(q, s, (128, 128))
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    x_q, x_s = quantize_groups(x)
    # reference: the quantized operands, dequantized, multiplied in float32
    ref = dequantize_block(x_q, x_s, (1, 128), torch.float32) @ dequantize_block(q, s, (128, 128), torch.float32).t()
    row = {"n": n, "k": k, "m": m, "tflop": 2 * m * n * k / 1e12}
    ours = triton_linear(x, fw).float()
    row["ours_err"] = ((ours - ref).abs().max() / ref.abs().max()).item()
    row["fp8_linear_takes_cublaslt"] = fl.block_scaled_gemm(x.device) and fl.takes_block_scales(fw)
    for name, fn in (("scaled_mm", block_scaled), ("_scaled_mm", legacy_scaled)):
        try:
            y = fn(x_q, x_s, fw).float()
            row[f"{name}_err"] = ((y - ref).abs().max() / ref.abs().max()).item()
            row[f"{name}_us"] = timed(lambda c, fn=fn: fn(x_q, x_s, fw))
            row[f"{name}_quantize_us"] = timed(lambda c, fn=fn: fn(*quantize_groups(x), fw))
        except Exception as e:  # (the probe's question: whether this torch takes these scales)
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    row["ours_us"] = timed(lambda c: triton_linear(x, fw))
    row["fp8_linear_us"] = timed(lambda c: fl.fp8_linear(x, fw))
    wb = w.to(torch.bfloat16)
    row["bf16_us"] = timed(lambda c: F.linear(x, wb))
    for key in [k_ for k_ in row if k_.endswith("_us")]:
        row[key.replace("_us", "_tflop_s")] = row["tflop"] / (row[key] * 1e-6)
    return row


def main():
    rows = []
    for shape, mats in SHAPES.items():
        for m in (64, 256, 512, 2048, 8192) if shape == "v2-lite" else (2048,):
            for name, n, k in mats:
                r = {"shape": shape, "matrix": name, **case(n, k, m)}
                rows.append(r)
                print(json.dumps({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in r.items()}),
                      file=sys.stderr)
    json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
