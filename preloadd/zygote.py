"""The zygote: a process that has imported torch and the worker code, never touched
CUDA, and forks ready-to-attach workers on request.

A fresh Python spends seconds importing torch before it can do anything; a fork of
this process starts where those imports left off. Each worker is double-forked so
that it is orphaned at once and adopted by the daemon (a child subreaper), which
then reaps it and sees its exit status, whether or not the zygote still lives.

Protocol on the inherited socketpair (one JSON line each way):
  daemon -> zygote  {"slot": k}            fork a worker for slot k
  zygote -> daemon  {"slot": k, "pid": p}  the worker's pid
The zygote writes {"ready": true} once its imports are done.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback


def _preload_imports() -> None:
    # Everything a worker imports, paid for once here instead of in every worker.
    import fastapi  # noqa: F401
    import torch  # noqa: F401
    import uvicorn  # noqa: F401

    import preload.worker.serve  # noqa: F401


def run_worker(spec: dict, listen_fd: int, log_path: str) -> int:
    """Become a worker: the body of a forked (or freshly spawned) worker process."""
    from preload.worker.serve import serve_from_spec

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sock = socket.socket(fileno=os.dup(listen_fd))
    return serve_from_spec(spec, sock)


def fork_worker(spec: dict, slot: int, listen_fd: int, log_dir: str, control: socket.socket) -> int:
    """Double-fork a worker; return its pid (it is already orphaned)."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        grandchild = os.fork()
        if grandchild == 0:
            os.close(w)
            os.close(control.detach())  # the worker must not hold the zygote's channel
            os.setsid()
            code = 1
            try:
                code = run_worker(spec | {"slot": slot}, listen_fd, f"{log_dir}/worker-{slot}.log")
            except BaseException:
                traceback.print_exc()  # stderr is the worker's log by now
            finally:
                sys.stderr.flush()
                os._exit(code)
        os.write(w, str(grandchild).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as pipe:
        pid = int(pipe.read())
    os.waitpid(child, 0)
    return pid


def main() -> None:
    spec = json.loads(sys.argv[1])
    listen_fd, control_fd = int(sys.argv[2]), int(sys.argv[3])
    control = socket.socket(fileno=control_fd)
    _preload_imports()
    stream = control.makefile("rw", buffering=1)
    stream.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in stream:  # ends when the daemon closes its end
        slot = json.loads(line)["slot"]
        pid = fork_worker(spec, slot, listen_fd, spec["state_dir"], control)
        stream.write(json.dumps({"slot": slot, "pid": pid}) + "\n")


if __name__ == "__main__":
    main()
