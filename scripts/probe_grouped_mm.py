"""A prefill's MoE layer three ways on the GPU, at V2-Lite's and V3's shapes, timed inside
CUDA graphs over rotating weight copies (sweep_kernels.timed): our Triton grouped GEMMs
(fused_moe), torch's grouped GEMM (`torch._grouped_mm`, CUTLASS on Hopper) over the pairs
sorted by expert, and one dense cuBLAS GEMM of the same FLOPs (the ceiling). Also whether
torch's scaled grouped GEMM takes DeepSeek's fp8 block scales, and the router's gate.
A probe, not product: its output decides kernels/fused_moe's prefill path.

    PYTHONPATH=$PWD/tests python3 scripts/probe_grouped_mm.py > probe.json
"""

import json
import sys

import torch
import torch.nn.functional as F

from sweep_kernels import COPIES, timed

from preload.kernels.fp8 import FP8
from preload.kernels.fused_moe import block_rows, fused_moe
from preload.kernels.fused_router import fused_route
from preload.kernels.moe_align import align_by_expert_triton
from preload.kernels.moe_prefill import moe_prefill
from preload.kernels.quant import Fp8Weight

dev = "cuda"
SHAPES = {"v2-lite": (64, 6, 2048, 1408), "v3": (256, 8, 7168, 2048)}


def torch_grouped_moe(x, ids, weights, w13, down, inner):
    """The layer through torch._grouped_mm: pairs sorted by expert, gate and up in one
    grouped GEMM over [E, 2I, D], SwiGLU, down, weighted, unsorted and summed."""
    t, k = ids.shape
    flat = ids.flatten()
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    order = flat.argsort(stable=True)
    xs = x.index_select(0, order // k)
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    h = F.silu(gu[:, :inner]) * gu[:, inner:]
    y = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)
    y = y * weights.flatten()[order, None].to(y.dtype)
    out = torch.empty_like(y)
    out[order] = y
    return out.view(t, k, -1).sum(1)


def tma_moe(x, ids, wts, gate, up, down, configs=None, block_m=None):
    e = (gate.q if isinstance(gate, Fp8Weight) else gate).shape[0]
    block_m = block_m or block_rows(ids.numel(), e)
    return moe_prefill(x, ids, wts, gate, up, down, align_by_expert_triton(ids, e, block_m), block_m, configs)


def cfg(bn, bk, warps, stages):
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


BF16_GATE_UP = [cfg(128, 64, 8, 3), cfg(128, 64, 8, 4), cfg(128, 64, 4, 3), cfg(64, 64, 4, 4), cfg(128, 32, 8, 4)]
BF16_DOWN = [cfg(256, 64, 8, 3), cfg(128, 64, 8, 4), cfg(256, 64, 8, 4), cfg(128, 64, 8, 3), cfg(256, 32, 8, 4)]
FP8_GATE_UP = [cfg(128, 128, 8, 3), cfg(128, 128, 8, 4), cfg(128, 128, 4, 3), cfg(128, 128, 4, 4)]
FP8_DOWN = FP8_GATE_UP


def fp8_copy(e, n, k):
    q = (torch.randn(e, n, k, device=dev) * 100).clamp(-448, 448).to(FP8)
    return Fp8Weight(q, torch.rand(e, -(-n // 128), -(-k // 128), device=dev) * 1e-4, (128, 128))


def tma_sweep():
    """moe_prefill's tiles: gate/up's swept with down's first, then down's with the best gate/up."""
    rows = []
    e, k, d, inner = SHAPES["v2-lite"]
    for quant in ("none", "fp8_block"):
        if quant == "none":
            copies = []
            for _ in range(COPIES):
                w = torch.randn(e, 3 * inner, d, device=dev, dtype=torch.bfloat16) * 0.02
                copies.append((w[:, :inner], w[:, inner:2 * inner], torch.randn(e, d, inner, device=dev, dtype=torch.bfloat16) * 0.02))
            gu_cfgs, dn_cfgs = BF16_GATE_UP, BF16_DOWN
        else:
            copies = [(fp8_copy(e, inner, d), fp8_copy(e, inner, d), fp8_copy(e, d, inner)) for _ in range(COPIES)]
            gu_cfgs, dn_cfgs = FP8_GATE_UP, FP8_DOWN
        for tokens in (2048, 8192):
            x = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)
            ids = torch.rand(tokens, e, device=dev).topk(k, dim=1).indices
            wts = torch.rand(tokens, k, device=dev)
            flop = 2 * tokens * k * d * inner * 3
            ref = fused_moe(x, ids, wts, *copies[0])
            base = timed(lambda c: fused_moe(x, ids, wts, *copies[c]))
            best_gu, best = None, float("inf")
            for which, cfgs in (("gate_up", gu_cfgs), ("down", dn_cfgs)):
                for c in cfgs:
                    configs = (c, dn_cfgs[0]) if which == "gate_up" else (best_gu, c)
                    try:
                        got = tma_moe(x, ids, wts, *copies[0], configs)
                        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                        us = timed(lambda i: tma_moe(x, ids, wts, *copies[i], configs))
                    except Exception as exc:
                        rows.append(dict(quant=quant, tokens=tokens, which=which, cfg=c, error=str(exc)[:200]))
                        print(rows[-1], file=sys.stderr)
                        continue
                    if which == "gate_up" and us < best:
                        best_gu, best = c, us
                    rows.append(dict(quant=quant, tokens=tokens, which=which, cfg=c, us=us, tflop_s=flop / us / 1e6,
                                     fused_moe_us=base, fused_moe_tflop_s=flop / base / 1e6, rel_err=err))
                    print(rows[-1], file=sys.stderr)
        del copies
        torch.cuda.empty_cache()
    return rows


DECODE_TILES = [(64, cfg(128, 64, 8, 4), cfg(256, 64, 8, 4)), (64, cfg(64, 128, 4, 4), cfg(128, 128, 4, 4)),
                (64, cfg(128, 128, 8, 3), cfg(128, 128, 8, 3)), (32, cfg(64, 128, 4, 4), cfg(128, 128, 4, 4)),
                (32, cfg(128, 64, 4, 4), cfg(128, 64, 4, 4)), (128, cfg(128, 64, 8, 4), cfg(256, 64, 8, 4))]


def decode_cases():
    """A decode step's MoE layer (bf16, V2-Lite), fused_moe against moe_prefill's kernels
    with one block of rows per expert, where the weights' reading is all the work."""
    from preload.kernels.moe_decode import fits, moe_decode

    rows = []
    e, k, d, inner = SHAPES["v2-lite"]
    copies = []
    for _ in range(COPIES):
        w = torch.randn(e, 3 * inner, d, device=dev, dtype=torch.bfloat16) * 0.02
        copies.append((w[:, :inner], w[:, inner:2 * inner], torch.randn(e, d, inner, device=dev, dtype=torch.bfloat16) * 0.02))
    for tokens in (16, 64, 128, 256, 512, 1024):
        x = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)
        ids = torch.rand(tokens, e, device=dev).topk(k, dim=1).indices
        wts = torch.rand(tokens, k, device=dev)
        ref = fused_moe(x, ids, wts, *copies[0])
        row = dict(tokens=tokens, fused_moe_us=timed(lambda c: fused_moe(x, ids, wts, *copies[c])))
        if fits(tokens, *copies[0], None):
            row["moe_decode_us"] = timed(lambda c: moe_decode(x, ids, wts, *copies[c], None))
        for block_m, gu, dn in DECODE_TILES:
            name = f"tma_{block_m}_{gu['BLOCK_N']}x{gu['BLOCK_K']}w{gu['num_warps']}_{dn['BLOCK_N']}x{dn['BLOCK_K']}"
            try:
                got = tma_moe(x, ids, wts, *copies[0], (gu, dn), block_m)
                err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                row[name] = (timed(lambda c: tma_moe(x, ids, wts, *copies[c], (gu, dn), block_m)), round(err, 4))
            except Exception as exc:
                row[name] = str(exc)[:120]
        rows.append(row)
        print(row, file=sys.stderr)
    return rows


def layer_cases():
    rows = []
    for shape, (e, k, d, inner) in SHAPES.items():
        copies = []
        for _ in range(COPIES):
            w = torch.randn(e, 3 * inner, d, device=dev, dtype=torch.bfloat16) * 0.02  # gate, up adjacent
            dn = torch.randn(e, d, inner, device=dev, dtype=torch.bfloat16) * 0.02
            copies.append((w[:, :inner], w[:, inner:2 * inner], dn, w[:, :2 * inner]))
        for tokens in (512, 2048, 8192):
            if shape == "v3" and tokens > 2048:
                continue
            x = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)
            ids = torch.rand(tokens, e, device=dev).topk(k, dim=1).indices
            wts = torch.rand(tokens, k, device=dev)
            ours = fused_moe(x, ids, wts, *copies[0][:3])
            theirs = torch_grouped_moe(x, ids, wts, copies[0][3], copies[0][2], inner)
            err = ((ours.float() - theirs.float()).abs().max() / ours.float().abs().max()).item()
            flop = 2 * tokens * k * d * inner * 3
            pairs_x = torch.randn(tokens * k, d, device=dev, dtype=torch.bfloat16)
            dense_w = torch.randn(3 * inner, d, device=dev, dtype=torch.bfloat16)
            row = dict(shape=shape, tokens=tokens, rel_err=err, tflop=flop / 1e12)
            for name, fn in (
                ("fused_moe", lambda c: fused_moe(x, ids, wts, *copies[c][:3])),
                ("tma", lambda c: tma_moe(x, ids, wts, *copies[c][:3])),
                ("torch_grouped", lambda c: torch_grouped_moe(x, ids, wts, copies[c][3], copies[c][2], inner)),
                ("cublas_dense", lambda c: pairs_x @ dense_w.T),
            ):
                us = timed(fn)
                row[name + "_us"] = us
                row[name + "_tflop_s"] = flop / us / 1e6
            rows.append(row)
            print(row, file=sys.stderr)
    return rows


def scaled_grouped_probe():
    """Whether F.scaled_grouped_mm takes 1x128 activation and 128x128 weight block scales."""
    e, k, d, inner = SHAPES["v2-lite"]
    m = 1024
    try:
        st = F.ScalingType
        a = torch.randn(m, d, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(e, inner, d, device=dev).to(torch.float8_e4m3fn)
        sa = torch.ones(m, d // 128, device=dev)
        sb = torch.ones(e, inner // 128 + 1, d // 128, device=dev)
        offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * (m // e)
        out = F.scaled_grouped_mm(a, b.transpose(1, 2), sa, st.BlockWise1x128, sb, st.BlockWise128x128, offs=offs)
        return {"ok": True, "shape": list(out.shape)}
    except Exception as exc:  # what the installed torch says
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def gate_cases():
    rows = []
    d, e = 2048, 64
    gates = [torch.randn(e, d, device=dev) for _ in range(COPIES)]  # float32, as the checkpoint's gate is kept
    for tokens in (2048, 8192):
        x = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)
        rows.append(dict(tokens=tokens,
                         fused_route_us=timed(lambda c: fused_route(x, gates[c], None, 6, 1, 1, "softmax", False, False, 1.0)),
                         torch_fp32_gate_us=timed(lambda c: F.linear(x.float(), gates[c].float())),
                         torch_bf16_gate_us=timed(lambda c: F.linear(x, gates[c].bfloat16(), None).float())))
        print(rows[-1], file=sys.stderr)
    return rows


if __name__ == "__main__":
    if sys.argv[1:] == ["--gate"]:
        print(json.dumps({"device": torch.cuda.get_device_name(), "gate": gate_cases()}, indent=1))
        sys.exit()
    if sys.argv[1:] == ["--decode"]:
        print(json.dumps({"device": torch.cuda.get_device_name(), "decode": decode_cases(), "gate": gate_cases()}, indent=1))
        sys.exit()
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "tma_sweep": tma_sweep(),
           "layer": layer_cases(),
           "scaled_grouped_mm_block_scales": scaled_grouped_probe(), "gate": gate_cases()}
    print(json.dumps(out, indent=1))
