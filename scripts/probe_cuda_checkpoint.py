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

    python3 scripts/probe_cuda_checkpoint.py [--mib 1024] > $OUT/probe-cuda-checkpoint.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ROLE_ARGS = 3  # argv: role, fd of its socket, MiB
CALL_TIMEOUT = 30.0  # seconds for each driver call


def cu():
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.cuInit(0) == 0
    return lib


def error_name(lib, rc: int) -> str:
    name = ctypes.c_char_p()
    lib.cuGetErrorName(rc, ctypes.byref(name))
    return (name.value or b"?").decode()


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

    arena = VmmArena(mib << 20, "cuda:0")
    view = arena.as_tensor().view(torch.int64)
    view.copy_(torch.arange(view.numel(), device="cuda:0", dtype=torch.int64) * 7)
    torch.cuda.synchronize()
    arena.seal()
    info = arena.info()
    send(sock, {"size": info.size, "device": info.device, "transport": info.transport}, arena.fds())
    receive(sock)  # until told to go
    arena.close()


def importer(sock: socket.socket, mib: int) -> None:
    import torch

    from preload.ipc.cuda import VmmMapping
    from preload.ipc.manifest import ArenaInfo

    msg, fds = receive(sock)
    mapping = VmmMapping(ArenaInfo(**msg), fds)
    mapped = mapping.base.view(torch.int64)
    own = torch.arange(mapped.numel() // 2, device="cuda:0", dtype=torch.int64) * 3

    def sums() -> dict:
        torch.cuda.synchronize()
        return {"mapped": int(mapped.sum()), "own": int(own.sum())}

    send(sock, {"sums": sums()})
    while True:
        msg, _ = receive(sock)
        if msg.get("go"):
            return
        try:
            send(sock, {"sums": sums()})
        except Exception as e:  # noqa: BLE001 (what the driver says after a restore is the finding)
            send(sock, {"error": repr(e)})


# ---- here -------------------------------------------------------------------------------


def spawn(role: str, mib: int) -> tuple[subprocess.Popen, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, __file__, role, str(theirs.fileno()), str(mib)], pass_fds=(theirs.fileno(),))
    theirs.close()
    return proc, ours


class LockArgs(ctypes.Structure):
    """CUcheckpointLockArgs: without one the lock waits for the process's work forever."""
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


def note(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)  # (where a hang stopped)


def checkpoint_cycle(lib, pid: int, lock_ms: int) -> dict:
    """Lock, checkpoint, restore, unlock `pid`; each call's result and seconds, and the
    GPU's used memory after the checkpoint and after the restore."""
    out = {}
    for step in ("Lock", "Checkpoint", "Restore", "Unlock"):
        call = getattr(lib, f"cuCheckpointProcess{step}")
        note(f"cuCheckpointProcess{step}({pid})")
        t, answer = time.perf_counter(), []
        # (in a thread: a call the driver never returns from would hold the probe, signals and all)
        worker = threading.Thread(target=lambda: answer.append(
            call(ctypes.c_int(pid), ctypes.byref(LockArgs(lock_ms)) if step == "Lock" else None)), daemon=True)
        worker.start()
        worker.join(CALL_TIMEOUT)
        if not answer:
            out[step.lower()] = {"result": f"no answer in {CALL_TIMEOUT:.0f} s"}
            break
        rc = answer[0]
        out[step.lower()] = {"result": error_name(lib, rc), "seconds": round(time.perf_counter() - t, 4)}
        if step in ("Checkpoint", "Restore"):
            out[step.lower()]["used_mib_after"] = used_mib()
        if rc != 0:
            break
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
    args = p.parse_args()

    def stop(*_):
        raise TimeoutError(f"no answer in {args.timeout} s")

    signal.signal(signal.SIGALRM, stop)
    signal.alarm(args.timeout)
    lib = cu()
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
        for name, proc in (("importer", imp), ("exporter", exp)):
            result[f"checkpoint_{name}"] = checkpoint_cycle(lib, proc.pid, args.lock_ms)
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
