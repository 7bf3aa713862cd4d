"""The zygote: a process that has imported torch and the worker code, never touched
CUDA, and forks ready-to-attach workers on request.

A fresh Python spends seconds importing torch before it can do anything; a fork of
this process starts where those imports left off. Each worker is double-forked so
that it is orphaned at once and adopted by the daemon (a child subreaper), which
then reaps it and sees its exit status, whether or not the zygote still lives.

Every worker also gets the read end of a "go" pipe: it warms up, then waits there for
the daemon to write the slot it is to serve (at once, or later for a spare).

Protocol on the inherited SOCK_SEQPACKET socketpair (one JSON message each way):
  daemon -> zygote  {"slot": k} or {"slot": null}    fork a worker for slot k, or a spare
  zygote -> daemon  {"pid": p} + the go pipe's write end (SCM_RIGHTS)
The zygote sends {"ready": true} once its imports are done.
"""

from __future__ import annotations

import gc
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


def run_worker(spec: dict, listen_fd: int, go_fd: int, log_path: str) -> int:
    """Become a worker: the body of a forked (or freshly spawned) worker process."""
    from preload.worker.serve import serve_from_spec

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sock = socket.socket(fileno=os.dup(listen_fd))
    return serve_from_spec(spec, sock, go_fd)


def log_name(slot: int | None) -> str:
    return "spares.log" if slot is None else f"worker-{slot}.log"


def fork_worker(spec: dict, slot: int | None, listen_fd: int, control: socket.socket) -> tuple[int, int]:
    """Double-fork a worker (already orphaned when this returns); return its pid and
    the write end of its go pipe."""
    go_r, go_w = os.pipe()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        grandchild = os.fork()
        if grandchild == 0:
            os.close(w)
            os.close(go_w)  # only the daemon may say go; and EOF must reach us if it dies
            os.close(control.detach())  # the worker must not hold the zygote's channel
            os.setsid()
            code = 1
            try:
                code = run_worker(spec | {"slot": slot}, listen_fd, go_r, f"{spec['state_dir']}/{log_name(slot)}")
            except BaseException:
                traceback.print_exc()  # stderr is the worker's log by now
            finally:
                sys.stderr.flush()
                os._exit(code)
        os.write(w, str(grandchild).encode())
        os._exit(0)
    os.close(w)
    os.close(go_r)
    with os.fdopen(r) as pipe:
        pid = int(pipe.read())
    os.waitpid(child, 0)
    return pid, go_w


def send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(msg).encode()], list(fds))


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the fds that came with it; None when the other end closed."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
    return (json.loads(data) if data else None), fds


def main() -> None:
    spec = json.loads(sys.argv[1])
    listen_fd, control_fd = int(sys.argv[2]), int(sys.argv[3])
    control = socket.socket(fileno=control_fd)
    _preload_imports()
    # What the imports built lives as long as we do: out of the collector's sight, a
    # worker's first collection neither scans it (~0.1 s) nor copies its pages on write.
    gc.freeze()
    send(control, {"ready": True, "pid": os.getpid()})
    while True:
        msg, _ = receive(control)
        if msg is None:  # the daemon closed its end
            return
        pid, go = fork_worker(spec, msg["slot"], listen_fd, control)
        send(control, {"pid": pid}, [go])
        os.close(go)


if __name__ == "__main__":
    main()
