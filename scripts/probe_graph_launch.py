"""What a CUDA graph's launch costs the host, by the kind and number of its nodes: graphs of
100 and 400 launches of a trivial torch op and of a trivial Triton kernel (with ten
scalar arguments, as ours take), each replayed with the GPU idle; the median host time of
`replay()`. `bench decode --profile` reports the same for the decode graph ("its launch on
the host"); the difference is what the decode graph's own nodes cost.

    python3 scripts/probe_graph_launch.py   (on a GPU, preload importable)

On an H200: 7.4 / 5.9 us at 100 nodes, 10.4 / 8.0 us at 400 (torch / Triton); the
v2-lite decode graph, 444 nodes: 110-250 us.
"""

import torch
import triton
import triton.language as tl

from preload.bench.decode import host_launch_us


@triton.jit
def _inc(x_ptr, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)


def captured(body) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and warmed outside the capture
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def main() -> None:
    x = torch.zeros(128, device="cuda")
    for nodes in (100, 400):
        for kind in ("torch", "triton"):
            def body(kind=kind, nodes=nodes):
                for _ in range(nodes):
                    if kind == "torch":
                        x.add_(1)
                    else:
                        _inc[(1,)](x, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, N=128)
            print(f"{kind} {nodes} nodes: host replay {host_launch_us(captured(body)):.1f} us", flush=True)


if __name__ == "__main__":
    main()
