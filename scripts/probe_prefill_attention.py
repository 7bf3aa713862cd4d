"""How fast the MLA prefill kernel (`mla_prefill._prefill_chunk`) runs at a prompt step's
shapes on the GPU, its tiles and pipelining swept, against torch's SDPA (cuDNN) on the
expanded q, k, v with the same work, as the bar. V2-Lite's heads (16; dn 128, dr 64, dv
128), one chunk (every context <= 4,096), bf16. A tuning tool, not product: it launches
the kernel with the meta-parameters it sweeps. results/kernels/prefill-attention-tma-h100.json
is its run at 460e7d9, whose kernel read the keys by pointer loads ("pointer") beside the
TMA form that replaced it ("tma").

    PYTHONPATH=$PWD/tests:$PWD/tests/kernels python3 scripts/probe_prefill_attention.py > probe.json
"""

import itertools
import json
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from preload.kernels import mla_prefill as mp
from preload.kernels.prefill import chunk_latents, prefill_plan

HEADS, DN, DR, DV, RANK = 16, 128, 64, 128, 512
# (contexts, new tokens of each): a 2,048-token prompt alone, 8 of 256, workload A's chunks,
# and a prompt's second chunk of 2,048 after 2,048 cached.
CASES = {"2048x1": ([2048], [2048]), "256x8": ([256] * 8, [256] * 8), "512x4": ([512] * 4, [512] * 4),
         "1024x2": ([1024] * 2, [1024] * 2), "2048x1c2048": ([4096], [2048])}


def case_inputs(name):
    from test_mla_prefill import prefill_case  # tests/kernels on PYTHONPATH
    lens, news = CASES[name]
    case = prefill_case(lens, news, HEADS, DN, DR, DV, RANK, page=64, fp8=False, seed=3)
    plan = prefill_plan(case["block_table"], case["context_lens"], case["q_starts"], 64, case["max_context"], sum(lens))
    c, k_pe = chunk_latents(case["pools"], plan.slots, torch.bfloat16)
    kv = c @ case["kv_b"].t()
    return case, plan, kv.contiguous(), k_pe.contiguous()


def launch(case, plan, kv, k_pe, out, state, cfg):
    """The kernel as mla_prefill launches it for one chunk holding every context, at tiles `cfg`."""
    bm, bn, warps, stages = cfg
    q_nope, q_pe = case["q_nope"], case["q_pe"]
    m, l, acc = state
    tiles = (TensorDescriptor.from_tensor(kv, [bn, DN]), TensorDescriptor.from_tensor(k_pe, [bn, DR]),
             TensorDescriptor.from_tensor(kv, [bn, DV]))
    grid = (plan.context_lens.numel(), triton.cdiv(case["max_q"], bm), HEADS)
    mp._prefill_chunk[grid](
        q_nope, q_pe, *tiles, plan.q_starts, plan.kv_starts, plan.context_lens, m, l, acc, out, 0, plan.total,
        case["scale"] * mp.LOG2_E, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), m.stride(0),
        acc.stride(0), acc.stride(1), out.stride(0), out.stride(1),
        DN=DN, DR=DR, DV=DV, PN=DN, PR=DR, PV=DV, HEAD_COLS=DN + DV, V_COL=DN, FINAL=True, DOT=tl.bfloat16,
        BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps, num_stages=stages)


def causal_flop(lens, news):
    return sum(2 * HEADS * (DN + DR + DV) * sum(c - n + i + 1 for i in range(n)) for c, n in zip(lens, news))


def sdpa_us(case, kv, k_pe, lens, news):
    """torch's SDPA (cuDNN where it takes these head dims) over each sequence, causal: the bar."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.cat([case["q_nope"], case["q_pe"]], -1)
    kvh = kv.view(-1, HEADS, DN + DV)
    k = torch.cat([kvh[..., :DN], k_pe[:, None].expand(-1, HEADS, -1)], -1)
    v = kvh[..., DN:]
    seqs, at_q, at_k = [], 0, 0
    for c, n in zip(lens, news):
        seqs.append((q[at_q:at_q + n].transpose(0, 1)[None], k[at_k:at_k + c].transpose(0, 1)[None].contiguous(),
                     v[at_k:at_k + c].transpose(0, 1)[None].contiguous()))
        at_q, at_k = at_q + n, at_k + c
    out = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                def run():
                    for qq, kk, vv in seqs:  # (queries are the last of the context: a bottom-right causal mask
                        # is what the kernel does; with no cached context it is the plain causal one)
                        torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=case["scale"])
                run()
                out[name] = do_bench(run, warmup=5, rep=50) * 1e3
        except Exception as e:  # a backend that does not take these shapes says why
            out[name] = f"{type(e).__name__}: {str(e)[:120]}"
    return out


def main():
    configs = [(bm, bn, 4 if bm == 64 else 8, stages) for bm, bn, stages in itertools.product((64, 128), (32, 64, 128),
                                                                                              (2, 3, 4))
               if not (bn == 128 and stages == 4)]
    results = []
    for name in CASES:
        lens, news = CASES[name]
        case, plan, kv, k_pe = case_inputs(name)
        rows = sum(news)
        flop = causal_flop(lens, news)
        out = torch.empty(rows, HEADS, DV, dtype=torch.bfloat16, device="cuda")
        state = mp._state_buffers(rows, HEADS, DV, "cuda")
        served = (mp.BLOCK_M, mp.BLOCK_N, mp.NUM_WARPS, mp.NUM_STAGES)
        launch(case, plan, kv, k_pe, out, state, served)
        want = out.clone()
        row = {"case": name, "gflop": flop / 1e9, "tiles": {}}
        for cfg in configs:
            key = "x".join(map(str, cfg))
            try:
                out.zero_()
                launch(case, plan, kv, k_pe, out, state, cfg)
                err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                us = do_bench(lambda: launch(case, plan, kv, k_pe, out, state, cfg), warmup=5, rep=40) * 1e3
                row["tiles"][key] = {"us": round(us, 1), "tflop_s": round(flop / us / 1e6, 1), "rel_err": round(err, 5)}
            except Exception as e:  # (tiles past the shared memory)
                row["tiles"][key] = f"{type(e).__name__}: {str(e)[:100]}"
        row["sdpa_us"] = sdpa_us(case, kv, k_pe, lens, news) if lens == news else None
        results.append(row)
        best = min(((v["us"], c) for c, v in row["tiles"].items() if isinstance(v, dict)), default=None)
        print(name, f"{flop / 1e9:.1f} GFLOP", "served:", row["tiles"].get("x".join(map(str, served))), "best:", best,
              "sdpa:", row["sdpa_us"], file=sys.stderr, flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "heads": HEADS, "dims": [DN, DR, DV], "results": results},
              sys.stdout, indent=1)


if __name__ == "__main__":
    main()
