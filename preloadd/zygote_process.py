"""The zygote process itself (launched by zygote.Zygote, whose docstring gives the
protocol): it imports torch and the worker code, then forks workers on the daemon's
request; and a worker's entry, forked from it or (--no-zygote) a fresh interpreter.

The fronts' HTTP stack, and GPU workers' Triton kernels, a zygote imports once it is ready, a
step at a time while no fork request waits (`next_request`): on a cold start whose load ends
before the zygote's imports do, the first core and front are forked at once and import them
themselves, beside each other, instead of waiting for the zygote to (0.7-1.2 s on an H200 host).

This module is the one place in preloadd/ that runs worker code (in the zygote and the
processes it forks, never in the daemon).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

from preload.ipc.protocol import log_output_to
from preload.kernels import ahead, triton_import_steps
from preload.options import ServeOptions, from_json
from preload.preloadd.zygote import link_pair, log_name, receive, send

IDLE_GRACE = 0.1  # seconds a zygote waits for a fork request before idle work: a daemon with
# a slot to fill asks within milliseconds of reading "ready"


# ---- in the worker --------------------------------------------------------------------------


def run_worker(spec: dict, listen_fd: int, link_fd: int, log_path: str) -> int:
    """Become a worker: the body of a forked (or freshly spawned) worker process."""
    from preload.worker.serve import serve_supervised

    log_output_to(log_path)
    ahead.wait_compiled(spec)  # (a core forked while the zygote's children compile kernels ahead)
    sock = socket.socket(fileno=os.dup(listen_fd))
    serve = from_json(ServeOptions, spec["serve"] | {"dp_rank": spec.get("dp_rank", 0)})
    return serve_supervised(serve, spec["slot"], sock, link_fd, spec.get("role", "core"), spec.get("tokenizer"))


def worker_main() -> None:
    """A worker started as a fresh interpreter (--no-zygote): argv is the spec, the
    listening socket's fd, the link's fd and the log path."""
    spec, listen_fd, link_fd, log_path = json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    sys.exit(run_worker(spec, listen_fd, link_fd, log_path))


# ---- in the zygote --------------------------------------------------------------------------


def _preload_imports() -> None:
    # What a core imports, paid for once here instead of in every worker; a front's HTTP stack
    # once ready (http_import_steps: a start's first front imports it beside its core's start).
    import torch  # noqa: F401

    import preload.worker.serve  # noqa: F401


def fork_worker(spec: dict, slot: int | None, listen_fd: int, control: socket.socket,
                role: str = "core") -> tuple[int, socket.socket]:
    """Double-fork a worker (already orphaned when this returns), the `role` of its slot's
    pair (worker/serve.py: a core or a front); return its pid and the daemon's end of its link."""
    ours, theirs = link_pair()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        grandchild = os.fork()
        if grandchild == 0:
            os.close(w)
            ours.close()  # EOF must reach the worker when the daemon's end closes
            os.close(control.detach())  # the worker must not hold the zygote's channel
            os.setsid()
            code = 1
            try:
                state_dir = spec["serve"]["state_dir"]
                code = run_worker(spec | {"slot": slot, "role": role}, listen_fd, theirs.detach(),
                                  f"{state_dir}/{log_name(slot, role)}")
            except BaseException:
                traceback.print_exc()  # stderr is the worker's log by now
            finally:
                sys.stderr.flush()
                os._exit(code)
        os.write(w, str(grandchild).encode())
        os._exit(0)
    os.close(w)
    theirs.close()
    with os.fdopen(r) as pipe:
        pid = int(pipe.read())
    os.waitpid(child, 0)
    return pid, ours


def next_request(control: socket.socket, idle_work: list[Callable[[], object]]) -> tuple[dict | None, list[int]]:
    """The daemon's next message. Until it comes, do `idle_work` a step at a time (each
    taken off the list once done), after IDLE_GRACE without one: a fork request waits at
    most for the step under way. A step that fails ends the idle work, not the zygote: the
    workers meet the same error at their own imports, and report it."""
    wait = IDLE_GRACE
    while idle_work and not select.select([control], [], [], wait)[0]:
        try:
            idle_work.pop(0)()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            idle_work.clear()
        wait = 0.0
    return receive(control)


def main() -> None:
    from setproctitle import setproctitle, setthreadtitle

    state_dir, control = sys.argv[1], socket.socket(fileno=int(sys.argv[2]))
    setproctitle(f"preload zygote --state-dir {state_dir}")
    # Its short name (comm) without the title's spaces: Python 3.12 counts a process's threads
    # at each fork from /proc/self/stat split at spaces, and would take "preload zygote" for a
    # process with threads ("use of fork() may lead to deadlocks"), in every fork's child too.
    setthreadtitle("preload-zygote")
    _preload_imports()
    from preload.worker.serve import http_import_steps
    if "--park" in sys.argv:  # to be dumped (`preload snapshot`), then restored for a state dir: its idle work
        kernels = sys.argv[sys.argv.index("--park") + 1] == "kernels"  # done before (the kernels: a GPU host's)
        for step in [*http_import_steps(), *(triton_import_steps() if kernels else [])]:
            step()
        setproctitle(f"preload zygote --state-dir {park(control)}")
    try:
        msg, fds = receive(control)
        if msg is None:  # the daemon closed its end before it got as far as its workers
            return
        spec, [listen_fd] = msg["spec"], fds
        os.environ.update(msg["env"])
        # What the imports built lives as long as we do: out of the collector's sight, a
        # worker's first collection neither scans it (~0.1 s) nor copies its pages on write.
        gc.freeze()
        idle_work = [*(triton_import_steps() if spec.get("gpu") else []), *http_import_steps(), gc.freeze]
        send(control, {"ready": True, "pid": os.getpid(), "at": time.time()})  # (wall clock: load_board.CELL says why)
        # (a host whose kernel cache lacks what the workers' list names: compiled beside the load)
        compiling = ahead.compile_listed() if spec.get("gpu") else None
        while True:
            if compiling and compiling.settled_unless_asked(control):  # (else the cores forked meanwhile wait)
                compiling = None
            msg, _ = next_request(control, idle_work)
            if msg is None:  # the daemon closed its end (kernels still compiling: stopped, not left as orphans)
                if compiling:
                    compiling.finish(0)
                return
            pid, link = fork_worker(spec | {"dp_rank": msg.get("dp_rank", 0)} | (compiling.handed() if compiling else {}),
                                    msg["slot"], listen_fd, control, msg.get("role", "core"))
            send(control, {"pid": pid}, [link.fileno()])
            link.close()
    except (BrokenPipeError, ConnectionResetError):  # the daemon died (the next one starts its own zygote)
        print("preload zygote: the daemon is gone; exiting", file=sys.stderr)


def park(control: socket.socket) -> str:
    """A zygote launched to be dumped (snapshot.py), its imports done: let go of this host
    (stdio to /dev/null, its working directory /), say "parked" with the control socket's
    inode (for CRIU) and stop. Continued after a restore: take the restoring daemon's stderr
    and environment, and return its state dir."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir("/")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    send(control, {"parked": True, "pid": os.getpid(), "socket": os.fstat(control.fileno()).st_ino})
    os.kill(os.getpid(), signal.SIGSTOP)
    msg, fds = receive(control)  # (a restore's; EOF: the dump failed and the taker let go)
    if msg is None:
        sys.exit(0)
    for fd in (1, 2):
        os.dup2(fds[0], fd)
    os.close(fds[0])
    os.environ.clear()
    os.environ.update(msg["env"])
    return msg["state_dir"]


if __name__ == "__main__":
    worker_main() if sys.argv[1] == "--worker" else main()
