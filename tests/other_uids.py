"""Another local user, for the tests of what the daemon lets other uids do: a forked
child that drops to uid and gid 65534 (nobody) and reports back as JSON."""

from __future__ import annotations

import json
import os
import select
import signal
from pathlib import Path

import pytest

NOBODY = 65534


def as_nobody(fn, *args, timeout: float = 60) -> dict:
    """fn(*args) in a forked child that dropped to uid and gid 65534; its JSON result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                result = fn(*args)
            except BaseException as e:
                result = {"crash": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    try:
        with os.fdopen(r, "rb") as pipe:
            while select.select([pipe], [], [], timeout)[0]:
                chunk = os.read(pipe.fileno(), 1 << 16)
                if not chunk:
                    break
                data += chunk
            else:
                pytest.fail(f"the uid {NOBODY} child did not finish within {timeout} s")
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    return json.loads(data)


def open_to_others(state_dir: Path) -> None:
    """What an operator does to let another uid reach the sockets at all; the daemon's
    uid check is then the only thing between that uid and the weights."""
    os.chmod(state_dir, 0o711)
    for name in ("control.sock", "fds.sock"):
        os.chmod(state_dir / name, 0o666)
