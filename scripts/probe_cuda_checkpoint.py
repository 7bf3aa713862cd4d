"""Probe (issue 37): does the CUDA driver's checkpoint (cuCheckpointProcessLock / Checkpoint /
Restore / Unlock) cover VMM memory that one process exports and another maps, as the
daemon's arena and a worker hold it?

Three processes, no torch in this one (the driver through ctypes: cuInit, no context):
  exporter  makes a cuda-vmm arena (ipc/cuda.VmmArena), fills it, seals it, sends its fd here
  importer  maps that fd read-only (VmmMapping, as a worker does) and allocates memory of
            its own (torch), both filled with known values
  here      checkpoints the importer, then the exporter, through the driver, reading the
            GPU's used memory (nvidia-smi) between the calls, restores each, and has the
            importer read both buffers again.
Prints one JSON object: every call's result (CUDA's error name), its seconds, the memory
used after each step, and whether the importer's bytes came back intact.

With --unmap-first, what a core kept through a sleep would do: the importer unmaps the
arena (its address range kept) before its checkpoint; between the checkpoint and the
restore the exporter frees its arena and makes a new one of the same bytes (the weights to
host memory and back); after the restore the importer maps the new arena at the old
address and replays a CUDA graph captured before, which reads it and its own memory.

    python3 scripts/probe_cuda_checkpoint.py [--mib 1024] [--unmap-first] > $OUT/probe-cuda-checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

from preload.ipc import cuda_checkpoint

ROLE_ARGS = 3  # argv: role, fd of its socket, MiB


def used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=30).stdout
    return int(out.split()[0]) if out.strip() else -1


def send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(msg).encode()], list(fds))


def receive(sock: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
    return json.loads(data), fds


# ---- the two CUDA processes -------------------------------------------------------------


def exporter(sock: socket.socket, mib: int) -> None:
    import torch

    from preload.ipc.cuda import VmmArena

    while True:
        arena = VmmArena(mib << 20, "cuda:0")
        view = arena.as_tensor().view(torch.int64)
        view.copy_(torch.arange(view.numel(), device="cuda:0", dtype=torch.int64) * 7)
        torch.cuda.synchronize()
        del view
        arena.seal()
        info = arena.info()
        send(sock, {"size": info.size, "device": info.device, "transport": info.transport}, arena.fds())
        msg, _ = receive(sock)  # until told to go, or to make it again
        arena.close()
        if not msg.get("renew"):
            return
        torch.cuda.synchronize()
        send(sock, {"freed": True})
        receive(sock)  # (the probe reads the memory used meanwhile)


def importer(sock: socket.socket, mib: int) -> None:
    import torch

    from preload.ipc.cuda import VmmMapping
    from preload.ipc.manifest import ArenaInfo

    msg, fds = receive(sock)
    mapping = VmmMapping(ArenaInfo(**msg), fds)
    mapped = mapping.base.view(torch.int64)
    own = torch.arange(mapped.numel() // 2, device="cuda:0", dtype=torch.int64) * 3
    graph, out = torch.cuda.CUDAGraph(), torch.zeros(1, device="cuda:0", dtype=torch.int64)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # (a first run outside capture, as the engine's graphs are made)
        out.copy_((mapped[: own.numel()] + own).sum())
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out.copy_((mapped[: own.numel()] + own).sum())

    def sums() -> dict:
        graph.replay()
        torch.cuda.synchronize()
        return {"mapped": int(mapped.sum()), "own": int(own.sum()), "graph": int(out.item())}

    send(sock, {"sums": sums()})
    while True:
        msg, fds = receive(sock)
        if msg.get("go"):
            return
        try:
            if msg.get("unmap"):  # the arena let go, its address range kept (as a kept spare does)
                t = time.perf_counter()
                mapping.let_go_keeping_address()
                send(sock, {"unmapped_s": round(time.perf_counter() - t, 4)})
                continue
            if msg.get("remap"):  # a new arena of the same bytes, at the old address
                t = time.perf_counter()
                mapping.map_again(ArenaInfo(**{k: v for k, v in msg.items() if k != "remap"}), fds)
                send(sock, {"remapped_s": round(time.perf_counter() - t, 4), "sums": sums()})
                continue
            send(sock, {"sums": sums()})
        except Exception as e:  # noqa: BLE001 (what the driver says after a restore is the finding)
            send(sock, {"error": repr(e)})


# ---- here -------------------------------------------------------------------------------


def spawn(role: str, mib: int) -> tuple[subprocess.Popen, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, __file__, role, str(theirs.fileno()), str(mib)], pass_fds=(theirs.fileno(),))
    theirs.close()
    return proc, ours


def note(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)  # (where a hang stopped)


def checkpoint_cycle(pid: int, between=None) -> dict:
    """Lock, checkpoint, restore, unlock `pid` (ipc/cuda_checkpoint.py, a call at a time);
    each call's result and seconds, and the GPU's used memory after the checkpoint and
    after the restore. `between`: called after the checkpoint, before the restore; what it
    returns is kept under "between"."""
    out = {}
    for step in ("Lock", "Checkpoint", "Restore", "Unlock"):
        note(f"cuCheckpointProcess{step}({pid})")
        t = time.perf_counter()
        try:
            cuda_checkpoint.call(step, pid)
            result = "CUDA_SUCCESS"
        except cuda_checkpoint.CheckpointError as e:
            result = str(e)
        out[step.lower()] = {"result": result, "seconds": round(time.perf_counter() - t, 4)}
        if step in ("Checkpoint", "Restore"):
            out[step.lower()]["used_mib_after"] = used_mib()
        if result != "CUDA_SUCCESS":
            break
        if step == "Checkpoint" and between is not None:
            out["between"] = between()
    return out


def unmap_first(imp: subprocess.Popen, imp_sock: socket.socket, exp_sock: socket.socket,
                before: dict) -> dict:
    """The --unmap-first sequence (above); each step's answer and the memory used after it."""
    out = {}
    note("importer: unmapping the arena")
    send(imp_sock, {"unmap": True})
    out["unmap"] = receive(imp_sock)[0] | {"used_mib_after": used_mib()}
    renewed = []

    def renew() -> dict:
        note("exporter: its arena freed, then made again")
        send(exp_sock, {"renew": True})
        receive(exp_sock)
        freed = used_mib()
        send(exp_sock, {"go_on": True})
        info, fds = receive(exp_sock)
        renewed.append((info, fds))
        return {"used_mib_arena_freed": freed, "used_mib_arena_again": used_mib()}

    out["cycle"] = checkpoint_cycle(imp.pid, renew)
    if renewed and out["cycle"].get("unlock", {}).get("result") == "CUDA_SUCCESS":
        info, fds = renewed[0]
        note("importer: the new arena at the old address")
        send(imp_sock, info | {"remap": True}, fds)
        answer = receive(imp_sock)[0]
        out["remap"] = answer | {"intact": answer.get("sums") == before}
    return out


def main() -> None:
    if len(sys.argv) == 1 + ROLE_ARGS and sys.argv[1] in ("exporter", "importer"):
        role, fd, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        (exporter if role == "exporter" else importer)(socket.socket(fileno=fd), mib)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="the exported arena's size; the importer's own is half")
    p.add_argument("--lock-ms", type=int, default=10_000, help="the lock's timeout")
    p.add_argument("--timeout", type=int, default=60, help="seconds for the whole probe; then what it found so far")
    p.add_argument("--unmap-first", action="store_true", help="the importer unmaps the arena before its checkpoint,"
                   " and maps a new one at the same address after its restore (above)")
    args = p.parse_args()

    def stop(*_):
        raise TimeoutError(f"no answer in {args.timeout} s")

    signal.signal(signal.SIGALRM, stop)
    signal.alarm(args.timeout)
    cuda_checkpoint.LOCK_TIMEOUT_MS = args.lock_ms
    result = {"mib": args.mib, "used_mib_before": used_mib()}
    exp, exp_sock = spawn("exporter", args.mib)
    imp, imp_sock = spawn("importer", args.mib)
    try:
        note("exporter: the arena")
        info, fds = receive(exp_sock)
        send(imp_sock, info, fds)
        for fd in fds:
            os.close(fd)
        note("importer: mapping it")
        result["sums_before"] = receive(imp_sock)[0]["sums"]
        result["used_mib_both_up"] = used_mib()
        if args.unmap_first:
            result["unmap_first"] = unmap_first(imp, imp_sock, exp_sock, result["sums_before"])
        else:
            for name, proc in (("importer", imp), ("exporter", exp)):
                result[f"checkpoint_{name}"] = checkpoint_cycle(proc.pid)
                note(f"importer: its sums after the {name}'s cycle")
                send(imp_sock, {"check": True})
                result[f"after_{name}"] = receive(imp_sock)[0]
                result[f"after_{name}"]["intact"] = result[f"after_{name}"].get("sums") == result["sums_before"]
    except TimeoutError as e:
        result["stopped"] = str(e)
    finally:
        signal.alarm(0)
        for sock in (imp_sock, exp_sock):
            try:
                send(sock, {"go": True})
            except OSError:
                pass
        for proc in (imp, exp):
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps(result, indent=1), flush=True)
    os._exit(0)  # (not waiting for a driver call that never returned)


if __name__ == "__main__":
    main()
