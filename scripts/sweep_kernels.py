"""Tile sweep of the hot decode kernels at V2-Lite shapes on the GPU, timed inside CUDA
graphs, rotating over several weight copies so L2 holds none of them between launches:
the grouped expert GEMMs (fused_moe), the MLA decode split kernel, the router's gate,
(`--dense`) the fp8 linear layer at a few rows against bf16 cuBLAS, (`--dense-serving`) bf16
cuBLAS against the grouped GEMM at serving's decode batches (the shared experts' SwiGLU too), and
(`--moe-decode`) a decode step's whole MoE layer, grouped GEMMs against moe_decode; (`--moe`)
the grouped GEMMs alone at decode's 1 to 256 tokens;
(`--mla`) the MLA decode at serving's batches and contexts, pipelining depth and splits too,
(`--mla-combine`) the combine of its splits alone, (`--mla-block`) the whole call over the loop's
step from batch 1 to 128, and
(`--prefill [--act]`) the grouped expert GEMMs at a prefill's thousands of tokens (`--act`:
with e4m3 activations, fp8_act.py).
It sets the kernels' module constants and tile hook directly: a tuning tool, not product.
Its output on an H200 is results/kernels/moe-tiles-h200.json; the choices it led to are in
fused_moe.tile_config, mla_decode (MIN_SPLIT, block_n) and fused_router.MIN_SPLIT_D.

Compile every variant first in parallel (Triton's disk cache keeps them), then time:

    for i in $(seq 0 11); do PYTHONPATH=$PWD/tests python3 scripts/sweep_kernels.py --compile-shard $i/12 & done; wait
    PYTHONPATH=$PWD/tests python3 scripts/sweep_kernels.py > sweep.json
"""

import itertools
import json
import sys
import time

import torch
import triton

from preload.kernels import fp8_linear as fl
from preload.kernels import fused_moe as fm
from preload.kernels import fused_router as fr
from preload.kernels import mla_decode as md
from preload.kernels.fp8 import FP8
from preload.kernels.moe_align import align_by_expert_triton
from preload.kernels.quant import Fp8Weight

E, D, I, K = 64, 2048, 1408, 6
COPIES = 3
REPS = 12
dev = "cuda"
torch.manual_seed(0)


def timed(fn_for_copy) -> float:
    """us per launch group: REPS calls over rotating copies, in one CUDA graph, best of 5."""
    for c in range(COPIES):
        fn_for_copy(c)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(REPS):
            fn_for_copy(i % COPIES)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / REPS)
    return best


def expert_weights(fp8: bool):
    out = []
    for _ in range(COPIES):
        ws = []
        for n, k in ((I, D), (I, D), (D, I)):
            w = (torch.randn(E, n, k, device=dev) * 0.02)
            if fp8:
                q = (w * 448 / 0.1).clamp(-448, 448).to(FP8)
                s = torch.rand(E, -(-n // 128), -(-k // 128), device=dev) * 1e-3
                ws.append(Fp8Weight(q, s, (128, 128)))
            else:
                ws.append(w.to(torch.bfloat16))
        out.append(ws)
    return out


CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
           for bn, bk, (w, s) in itertools.product((32, 64, 128), (64, 128, 256), ((4, 3), (4, 4), (4, 5), (8, 3), (8, 4)))]


def moe_cases():
    # (100: workload B's decode batch, block_rows' 32 there: 600 pairs over 64 experts)
    for tokens, block_ms in ((1, (16,)), (16, (16,)), (64, (16, 32, 64)), (100, (16, 32)), (256, (16, 32, 64))):
        for block_m in block_ms:
            for fp8 in (False, True):
                for kind in ("gate_up", "down"):
                    yield tokens, block_m, fp8, kind


# Prefill (--prefill): thousands of tokens, 190 to 770 rows per expert; compute-bound.
# fp8 "act": e4m3 activations too (fp8_act.py), the fp8 tensor cores; gate/up then writes
# e4m3 with a scale per 128 columns, so its tiles are 128 wide.
PREFILL_CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
                   for bn, bk, w, s in ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4),
                                        (128, 128, 8, 3), (64, 128, 4, 4), (256, 64, 8, 3))]
ACT_CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
               for bn, bk, w, s in ((128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 4),
                                    (128, 64, 4, 4), (256, 128, 8, 3), (256, 64, 8, 4))]


def moe_prefill_cases(act=False):
    for tokens in (2048, 8192):
        for block_m in (64, 128):
            for fp8 in (("act",) if act else (False, True)):
                for kind in ("gate_up", "down"):
                    yield tokens, block_m, fp8, kind


def moe_sweep(shard=None, prefill=False, act=False):
    from preload.kernels.fp8_act import quantize_groups

    results = []
    weights = {False: expert_weights(False), True: expert_weights(True)}
    weights["act"] = weights[True]
    cases, configs = ((moe_prefill_cases(act), ACT_CONFIGS if act else PREFILL_CONFIGS) if prefill
                      else (moe_cases(), CONFIGS))
    jobs = [(case, cfg) for case in cases for cfg in configs
            if not (case[3] == "gate_up" and cfg["BLOCK_N"] > 128)]  # (two accumulators of 256 columns spill)
    if shard:
        i, n = shard
        jobs = jobs[i::n]
    prepared = {}
    for (tokens, block_m, fp8, kind), cfg in jobs:
        key = (tokens, block_m)
        if key not in prepared:
            ids = torch.rand(tokens, E, device=dev).topk(K, dim=1).indices
            route = torch.rand(tokens * K, device=dev)
            x = torch.randn(tokens, D, device=dev, dtype=torch.bfloat16)
            h = torch.randn(tokens * K, I, device=dev, dtype=torch.bfloat16)
            prepared[key] = (align_by_expert_triton(ids, E, block_m), route, x, h)
        aligned, route, x, h = prepared[key]
        pairs = tokens * K
        if fp8 and 128 % cfg["BLOCK_K"]:
            continue
        fm.tile_config = lambda *a, cfg=cfg: cfg
        ws = weights[fp8]
        if fp8 == "act" and kind == "gate_up":
            (xq, xs), hs = quantize_groups(x), torch.empty(pairs, I // 128, device=dev)
            out = torch.empty(pairs, I, device=dev, dtype=FP8)
            fn = lambda c: fm._launch(xq, ws[c][0], out, aligned, pairs, K, block_m, w2=ws[c][1], a_scale=xs,  # noqa: E731
                                      out_scale=hs)
        elif fp8 == "act":
            hq, hs = quantize_groups(h)
            out = torch.empty(pairs, D, device=dev, dtype=torch.bfloat16)
            fn = lambda c: fm._launch(hq, ws[c][2], out, aligned, pairs, K, block_m, route=route,  # noqa: E731
                                      rows_per_pair=True, a_scale=hs)
        elif kind == "gate_up":
            out = torch.empty(pairs, I, device=dev, dtype=torch.bfloat16)
            fn = lambda c: fm._launch(x, ws[c][0], out, aligned, pairs, K, block_m, w2=ws[c][1])  # noqa: E731
        else:
            out = torch.empty(pairs, D, device=dev, dtype=torch.bfloat16)
            fn = lambda c: fm._launch(h, ws[c][2], out, aligned, pairs, K, block_m, route=route, rows_per_pair=True)  # noqa: E731
        try:
            us = timed(fn) if not shard else (fn(0), torch.cuda.synchronize(), 0.0)[2]
        except Exception as e:  # out of shared memory, etc.
            us = None
            print(f"{tokens} {block_m} {fp8} {kind} {cfg}: {type(e).__name__} {str(e)[:100]}", file=sys.stderr)
        flop = 2 * pairs * D * I * (2 if kind == "gate_up" else 1)
        results.append(dict(tokens=tokens, block_m=block_m, fp8=fp8, kind=kind, us=us, **cfg,
                            tflop_s=flop / us / 1e6 if us else None))
        if prefill:
            print(results[-1], file=sys.stderr)
    return results


def mla_split(case, splits: int, block_n: int, min_split: int, **launch) -> None:
    """The MLA decode split kernel alone over one paged case (V2-Lite's 16 heads, rank 512,
    bf16 cache), each sequence cut into `splits`; `launch`: num_warps, num_stages."""
    q_lat, q_pe, pools, table, lens = case
    batch = q_lat.shape[0]
    parts = torch.empty(batch, 16, splits, 512, dtype=torch.float32, device=dev)
    lse = torch.empty(batch, 16, splits, dtype=torch.float32, device=dev)
    md._mla_decode_split[(batch, 1, splits)](
        q_lat, q_pe, pools.ptrs, table, lens, parts, lse, 16, 0.1,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), table.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2),
        R=512, DR=64, PAGE=16, CACHE=triton.language.bfloat16, FP8=False, DOT=triton.language.bfloat16,
        BLOCK_H=16, BLOCK_N=block_n, MIN_SPLIT=min_split, **launch)


def mla_sweep():
    from kernel_cases import paged_case

    results = []
    for batch, ctx in ((1, 1024), (1, 8192), (16, 1024), (64, 1024), (64, 8192), (256, 1024)):
        cases = [paged_case([ctx] * batch, 16, 512, 64, 16, False, seed=s) for s in range(COPIES)]
        width = 163840
        for min_split, block_n, warps in itertools.product((16, 32, 64, 128), (16, 32, 64), (4, 8)):
            if min_split < block_n:
                continue
            md.MIN_SPLIT = min_split  # (splits_for reads it)
            splits = md.splits_for(batch, 16, width)

            def fn(c, splits=splits, warps=warps, block_n=block_n, min_split=min_split):
                mla_split(cases[c], splits, block_n, min_split, num_warps=warps)
            try:
                us = timed(fn)
            except Exception as e:
                us = None
                print(f"mla {batch} {ctx} {min_split} {block_n} {warps}: {str(e)[:100]}", file=sys.stderr)
            results.append(dict(batch=batch, ctx=ctx, min_split=min_split, block_n=block_n, warps=warps, splits=splits, us=us))
        # the whole call as the model makes it (split + combine), at the current settings
    return results


def mla_combine_sweep():
    """The MLA decode's combine of the splits alone (its partials made by the split kernel
    first), over the rank's columns a program takes (BLOCK_R) and warps; "as served" is
    combine_tile's choice with one warp."""
    from kernel_cases import paged_case

    results = []
    for batch, ctx in ((1, 1024), (1, 8192), (64, 1024), (128, 1024), (128, 2048)):
        case = paged_case([ctx] * batch, 16, 512, 64, 16, False)
        q_lat, _, _, _, lens = case
        splits, bn = md.splits_for(batch, 16, 163840), md.block_n(batch)
        parts = torch.empty(batch, 16, splits, 512, dtype=torch.float32, device=dev)
        lse = torch.empty(batch, 16, splits, dtype=torch.float32, device=dev)
        md._mla_decode_split[(batch, 1, splits)](
            q_lat, case[1], case[2].ptrs, case[3], lens, parts, lse, 16, 0.1,
            q_lat.stride(0), q_lat.stride(1), case[1].stride(0), case[1].stride(1), case[3].stride(0),
            parts.stride(0), parts.stride(1), parts.stride(2),
            R=512, DR=64, PAGE=16, CACHE=triton.language.bfloat16, FP8=False, DOT=triton.language.bfloat16,
            BLOCK_H=16, BLOCK_N=bn, MIN_SPLIT=md.MIN_SPLIT, num_warps=4)
        out = torch.empty_like(q_lat)
        for block_r, warps in itertools.product((64, 128, 256, 512), (1, 2, 4, 8)):
            def fn(c, block_r=block_r, warps=warps):
                md._mla_decode_combine[(batch, 16, 512 // block_r)](
                    parts, lse, lens, out, 16, splits, parts.stride(0), parts.stride(1), parts.stride(2), out.stride(0),
                    out.stride(1), SPLITS=triton.next_power_of_2(splits), CHUNK=md.combine_tile(splits, 512)[0],
                    BLOCK_R=block_r, MIN_SPLIT=md.MIN_SPLIT, BLOCK_N=bn, num_warps=warps)
            results.append(dict(batch=batch, ctx=ctx, splits=splits, block_r=block_r, warps=warps, us=timed(fn)))
        best = min((r for r in results if r["batch"] == batch and r["ctx"] == ctx), key=lambda r: r["us"])
        served = next(r for r in results if r["batch"] == batch and r["ctx"] == ctx
                      and r["block_r"] == md.combine_tile(splits, 512)[1] and r["warps"] == 1)
        print(f"mla combine {batch}x{ctx} ({splits} splits): as served {served['us']:.1f} us, best", best, file=sys.stderr)
    return results


def mla_serving_sweep():
    """The MLA decode split kernel at serving's batches and contexts (workloads A and B:
    64 to 128 sequences, 1k to 2k tokens), with pipelining depth and splits swept too:
    its best at batch 64-256 read 1.1-1.3 TB/s, a quarter of the H200's HBM. Each row's
    `tb_s`: the cache's bytes read (576 bf16 values a token) over the time."""
    from kernel_cases import paged_case

    results = []
    for batch, ctx in ((64, 1024), (128, 1024), (128, 2048)):
        cases = [paged_case([ctx] * batch, 16, 512, 64, 16, False, seed=s) for s in range(COPIES)]
        nbytes = batch * ctx * 576 * 2
        for block_n, warps, stages, programs in itertools.product((16, 32, 64), (4, 8), (1, 2, 3, 4), (132, 264, 528)):
            splits = max(1, min(triton.cdiv(programs, batch), ctx // block_n, md.MAX_SPLITS))

            def fn(c, splits=splits, warps=warps, block_n=block_n, stages=stages):
                mla_split(cases[c], splits, block_n, block_n, num_warps=warps, num_stages=stages)
            try:
                us = timed(fn)
            except Exception as e:  # out of shared memory or registers
                us = None
                print(f"mla {batch} {ctx} bn{block_n} w{warps} st{stages} p{programs}: {str(e)[:100]}", file=sys.stderr)
            results.append(dict(batch=batch, ctx=ctx, block_n=block_n, warps=warps, stages=stages, splits=splits, us=us,
                                tb_s=nbytes / (us * 1e-6) / 1e12 if us else None))
        full = timed(lambda c: md.mla_decode_latent(*cases[c][:4], cases[c][4], 16, 163840, 0.1))
        best = min((r for r in results if r["batch"] == batch and r["ctx"] == ctx and r["us"]), key=lambda r: r["us"])
        results.append(dict(batch=batch, ctx=ctx, default_call_us=full, default_tb_s=nbytes / (full * 1e-6) / 1e12))
        print(f"mla {batch}x{ctx}: as served {full:.1f} us ({nbytes / full / 1e6:.2f} TB/s), best split alone", best,
              file=sys.stderr)
    return results


def mla_block_sweep():
    """The whole MLA decode call (split + combine, splits as served) over the loop's step
    (block_n 16 / 32 / 64) from batch 1 to 128: where the served block_n should change."""
    from kernel_cases import paged_case

    served, results = md.block_n, []
    for batch, ctx in itertools.product((1, 4, 8, 16, 24, 32, 48, 64, 128), (1024, 4096)):
        cases = [paged_case([ctx] * batch, 16, 512, 64, 16, False, seed=s) for s in range(COPIES)]
        row = dict(batch=batch, ctx=ctx, served=served(batch))
        for bn in (16, 32, 64):
            md.block_n = lambda _, bn=bn: bn  # (mla_decode_latent reads the module's)
            row[f"us_{bn}"] = timed(lambda c: md.mla_decode_latent(*cases[c][:4], cases[c][4], 16, 163840, 0.1))
        md.block_n = served
        results.append(row)
        print("mla block", row, file=sys.stderr)
    return results


def full_call_mla():
    from kernel_cases import paged_case
    results = []
    for batch, ctx in ((1, 1024), (1, 8192), (64, 1024)):
        cases = [paged_case([ctx] * batch, 16, 512, 64, 16, False, seed=s) for s in range(COPIES)]
        fn = lambda c: md.mla_decode_latent(*cases[c][:4], cases[c][4], 16, 163840, 0.1)  # noqa: E731
        results.append(dict(batch=batch, ctx=ctx, us=timed(fn), min_split=md.MIN_SPLIT, block_n=md.block_n(batch)))
    return results


def gate_sweep():
    results = []
    gates = [torch.randn(E, D, device=dev) * 0.02 for _ in range(COPIES)]
    for tokens in (1, 16, 64, 256):
        x = torch.randn(tokens, D, device=dev, dtype=torch.bfloat16)
        for min_split in (64, 128, 256, 512):
            fr.MIN_SPLIT_D = min_split
            try:
                us = timed(lambda c: fr.fused_route(x, gates[c], None, K, 1, 1, "softmax", False, False, 1.0))
            except Exception as e:
                us = None
                print(f"gate {tokens} {min_split}: {str(e)[:100]}", file=sys.stderr)
            results.append(dict(tokens=tokens, min_split_d=min_split, us=us))
    return results


DENSE = {"kv_a": (576, 2048), "q": (3072, 2048), "o": (2048, 2048), "shared_gate": (2816, 2048),
         "shared_down": (2048, 2816), "dense_gate": (10944, 2048), "dense_down": (2048, 10944)}


def dense_sweep():
    """V2-Lite's dense matrices at 1 to 16 rows: bf16 through cuBLAS, e4m3 through the
    split-K kernel (block_n 32 to 128) and through the grouped GEMM (the path before it)."""
    from preload.kernels.fp8 import quantize_block

    results = []
    for name, (n, k) in DENSE.items():
        bf = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        q8 = [Fp8Weight(*quantize_block(w.float()), (128, 128)) for w in bf]
        for t in (1, 2, 16):
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            row = dict(matrix=name, n=n, k=k, rows=t, bf16_us=timed(lambda c: torch.nn.functional.linear(x, bf[c])))
            for bn in (32, 64):
                row[f"gemv_bn{bn}_us"] = timed(lambda c: fl.split_k_gemv(x, q8[c], block_n=bn))
            grouped = fl.GEMV_ROWS
            fl.GEMV_ROWS = 0
            row["grouped_us"] = timed(lambda c: fl.fp8_linear(x, q8[c]))
            fl.GEMV_ROWS = grouped
            row["bf16_bytes_us_at_4.8TB"] = n * k * 2 / 4.8e6
            results.append(row)
            print(row, file=sys.stderr)
    results += absorb_sweep()
    return results


def dense_serving_sweep():
    """V2-Lite's dense bf16 matrices at serving's decode batches (64 to 256 rows): cuBLAS
    against the grouped GEMM with one expert (as fp8_linear runs e4m3 rows past GEMV_ROWS),
    and the shared experts' gate, up and SiLU: three cuBLAS launches and two elementwise ones
    against one grouped GEMM with SWIGLU. GB/s of the matrices read."""
    results = []
    for t in (64, 100, 128, 256):
        x = torch.randn(t, D, device=dev, dtype=torch.bfloat16)
        block_m = fl.one_expert_block(t)  # (fp8_linear's choice, and its layout)
        aligned = fl.one_expert_layout(t, block_m, dev)
        for name, (n, k) in DENSE.items():
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
            a = x if k == D else torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
            row = dict(matrix=name, n=n, k=k, rows=t, cublas_us=timed(lambda c: torch.nn.functional.linear(a, ws[c])),
                       grouped_us=timed(lambda c: fm._launch(a, ws[c][None], out, aligned, t, 1, block_m, rows_per_pair=True)))
            for key in ("cublas", "grouped"):
                row[f"{key}_gb_s"] = n * k * 2 / row[f"{key}_us"] / 1e3
            results.append(row)
            print(row, file=sys.stderr)
        n = DENSE["shared_gate"][0]
        gates = [torch.randn(n, D, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        ups = [torch.randn(n, D, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        h = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
        F = torch.nn.functional
        row = dict(matrix="shared_swiglu", n=n, k=D, rows=t,
                   cublas_us=timed(lambda c: F.silu(F.linear(x, gates[c])) * F.linear(x, ups[c])),
                   grouped_us=timed(lambda c: fm._launch(x, gates[c][None], h, aligned, t, 1, block_m,
                                                         w2=ups[c][None], rows_per_pair=True)))
        for key in ("cublas", "grouped"):
            row[f"{key}_gb_s"] = 2 * n * D * 2 / row[f"{key}_us"] / 1e3
        results.append(row)
        print(row, file=sys.stderr)
    return results


def absorb_sweep():
    """MLA's absorbed products (16 heads, 128 by 512 each, bf16): cuBLAS's einsum against head_matvec."""
    from preload.kernels.attention import absorbed_weights, per_head

    results = []
    ws = [absorbed_weights((torch.randn(16 * 256, 512, device=dev) * 0.05).to(torch.bfloat16), 16, 128)
          for _ in range(COPIES)]
    for t in (1, 2, 16):
        q = torch.randn(t, 16, 128, device=dev, dtype=torch.bfloat16)
        latent = torch.randn(t, 16, 512, device=dev, dtype=torch.bfloat16)
        for name, x, eq, w in (("w_uk", q, "bhd,hdr->bhr", lambda c: ws[c][0]), ("w_uv", latent, "bhr,hvr->bhv", lambda c: ws[c][1])):
            view = (lambda c: w(c).transpose(1, 2)) if name == "w_uk" else w
            row = dict(matrix=name, rows=t, einsum_us=timed(lambda c: torch.einsum(eq, x, w(c))),
                       head_matvec_us=timed(lambda c: per_head(x, view(c))))
            results.append(row)
            print(row, file=sys.stderr)
    return results


def moe_decode_sweep():
    """A whole MoE layer of one to four tokens (6 routed experts and the shared ones, V2-Lite):
    the grouped GEMMs plus the shared MLP (the path before moe_decode) against moe_decode's
    two launches over its block widths, K slices and warps."""
    from preload.kernels import moe_decode as dm
    from preload.kernels.fp8 import quantize_block
    from preload.kernels.moe import swiglu

    results = []
    shared_i = 2 * I
    for fp8 in (False, True):
        ws = expert_weights(fp8)

        def shared_weight(n, k):
            w = torch.randn(n, k, device=dev) * 0.02
            return Fp8Weight(*quantize_block(w), (128, 128)) if fp8 else w.to(torch.bfloat16)

        shared = [tuple(shared_weight(n, k) for n, k in ((shared_i, D), (shared_i, D), (D, shared_i)))
                  for _ in range(COPIES)]
        bytes_read = (K * 3 * I * D + 3 * shared_i * D) * (1 if fp8 else 2)
        for tokens in (1, 2, 4):
            ids = torch.rand(tokens, E, device=dev).topk(K, dim=1).indices
            route = torch.rand(tokens, K, device=dev)
            x = torch.randn(tokens, D, device=dev, dtype=torch.bfloat16)
            row = dict(fp8=fp8, tokens=tokens, ideal_us_at_4_8TB=bytes_read / 4.8e6,
                       grouped_us=timed(lambda c: fm.fused_moe(x, ids, route, *ws[c]) + swiglu(x, *shared[c])))
            for block_n, splits, sub, warps in itertools.product((16, 32, 64), (1, 2, 4), (2, 4), (4, 8)):
                config = dict(block_n=block_n, splits=splits, sub=sub, num_warps=warps)
                key = f"decode_bn{block_n}_s{splits}_sub{sub}_w{warps}_us"
                try:
                    row[key] = timed(lambda c: dm.moe_decode(x, ids, route, *ws[c], shared[c], config=config))
                except Exception as e:  # out of registers, etc.
                    row[key] = None
                    print(f"{key}: {type(e).__name__} {str(e)[:100]}", file=sys.stderr)
            row["decode_default_us"] = timed(lambda c: dm.moe_decode(x, ids, route, *ws[c], shared[c]))
            best = min((k for k in row if k.startswith("decode_") and row[k]), key=row.get)
            print({k: row[k] for k in ("fp8", "tokens", "ideal_us_at_4_8TB", "grouped_us")}, best, row[best],
                  file=sys.stderr)
            results.append(row)
    return results


# A flag alone: its sweep, under its key in the JSON written
ONE_SWEEP = {"--moe-decode": ("moe_decode", moe_decode_sweep), "--mla-combine": ("mla_combine", mla_combine_sweep),
             "--mla-block": ("mla_block", mla_block_sweep), "--mla": ("mla_serving", mla_serving_sweep),
             "--dense": ("dense", dense_sweep), "--moe": ("moe", moe_sweep),
             "--dense-serving": ("dense_serving", dense_serving_sweep)}

if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] in ONE_SWEEP:
        key, sweep = ONE_SWEEP[sys.argv[1]]
        json.dump({key: sweep()}, sys.stdout, indent=1)
        sys.exit(0)
    if len(sys.argv) > 2 and sys.argv[1] == "--compile-shard":
        i, n = map(int, sys.argv[2].split("/"))
        COPIES = 1
        moe_sweep((i, n), prefill="--prefill" in sys.argv, act="--act" in sys.argv)
        sys.exit(0)
    if sys.argv[1:2] == ["--prefill"]:
        json.dump({"moe_prefill": moe_sweep(prefill=True, act="--act" in sys.argv)}, sys.stdout, indent=1)
        sys.exit(0)
    t = time.time()
    out = {"moe": moe_sweep(), "moe_s": time.time() - t}
    print(f"moe sweep {time.time() - t:.0f} s", file=sys.stderr)
    out["mla_full_default"] = full_call_mla()
    out["mla"] = mla_sweep()
    out["gate"] = gate_sweep()
    out["total_s"] = time.time() - t
    json.dump(out, sys.stdout, indent=1)
