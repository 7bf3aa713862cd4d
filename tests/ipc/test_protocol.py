"""The control protocol against a running daemon, spoken raw: malformed, foreign or
unknown messages get an error reply and the daemon keeps serving everyone else;
clients of another uid are refused unless allow-listed; a flood of connections is
bounded per process, costs the daemon no memory and keeps nobody else from attaching;
no pickle anywhere."""

from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time
from pathlib import Path

import msgpack
import psutil
import pytest
from daemons import running_daemon
from other_uids import NOBODY, as_nobody, open_to_others

import preload
from preload import attach
from preload.ipc.client import DaemonClient, DaemonError
from preload.ipc.protocol import PROTOCOL_VERSION, ProtocolError, recv_with_fds, send_with_fds
from preload.preloadd.control import MAX_REQUEST, PER_PROCESS

REPLY_TIMEOUT_MS = 3000


@pytest.fixture(scope="module")
def daemon(tiny_checkpoint, base_dir):
    with running_daemon(base_dir / "state", tiny_checkpoint) as d:
        yield d


# ---- raw frames on the control socket ---------------------------------------------


def framed(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


@pytest.fixture
def control(daemon):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(REPLY_TIMEOUT_MS / 1000)
        sock.connect(str(daemon.state_dir / "control.sock"))
        yield sock


def exchange(sock: socket.socket, payload: bytes) -> dict:
    sock.sendall(framed(payload))
    try:
        reply, fds = recv_with_fds(sock, max_fds=0)
    except TimeoutError:
        pytest.fail("the daemon did not reply")
    assert fds == [] and isinstance(reply, dict), reply
    return reply


def still_serves(sock: socket.socket) -> None:
    reply = exchange(sock, msgpack.packb({"v": PROTOCOL_VERSION, "op": "status"}))
    assert reply["ok"] is True and reply["status"]["state"] == "ready"


BAD_MESSAGES = {
    "garbage": (b"\xc1 this is not msgpack \xff\x00", None),
    "empty": (b"", None),
    "truncated": (msgpack.packb({"v": PROTOCOL_VERSION, "op": "status"})[:-3], None),
    "not-a-map": (msgpack.packb([1, 2, 3]), None),
    "a-bare-string": (msgpack.packb("status"), None),
    "non-string-keys": (msgpack.packb({1: "status"}), None),
    "no-version": (msgpack.packb({"op": "status"}), "version"),
    "wrong-version": (msgpack.packb({"v": 99, "op": "status"}), "99"),
    "unknown-op": (msgpack.packb({"v": PROTOCOL_VERSION, "op": "format_disk"}), "format_disk"),
    "no-op": (msgpack.packb({"v": PROTOCOL_VERSION}), "op"),
}


@pytest.mark.parametrize("kind", list(BAD_MESSAGES))
def test_a_bad_request_gets_an_error_reply_and_the_daemon_keeps_serving(kind, daemon, control):
    payload, mentions = BAD_MESSAGES[kind]
    errors = daemon.metrics()["preload_errors_total"]
    reply = exchange(control, payload)
    assert reply["ok"] is False
    assert isinstance(reply["error"], str) and reply["error"]
    assert "internal error" not in reply["error"], "a malformed request is the client's fault, not a daemon bug"
    if mentions:
        assert mentions in reply["error"]
    assert reply.get("v") == PROTOCOL_VERSION
    assert daemon.metrics()["preload_errors_total"] == errors + 1
    still_serves(control)  # (on the same connection: a bad request costs the peer nothing more)


def test_requests_sent_together_are_answered_in_order(daemon, control):
    ask = [framed(msgpack.packb({"v": PROTOCOL_VERSION, "op": op})) for op in ("status", "format_disk", "status")]
    control.sendall(b"".join(ask))
    replies = [recv_with_fds(control, max_fds=0)[0] for _ in ask]
    assert [r["ok"] for r in replies] == [True, False, True], replies
    assert "format_disk" in replies[1]["error"]


# ---- the fd socket ---------------------------------------------------------------


def fd_exchange(daemon, raw: bytes) -> tuple[dict, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(REPLY_TIMEOUT_MS / 1000)
        sock.connect(str(daemon.state_dir / "fds.sock"))
        sock.sendall(raw)
        try:
            return recv_with_fds(sock)
        except TimeoutError:
            pytest.fail("the daemon did not reply on the fd socket")
        except (ProtocolError, ConnectionError) as e:
            pytest.fail(f"the daemon hung up on the fd socket without an error reply ({e})")


def still_serves_fds(daemon) -> None:
    with DaemonClient(daemon.state_dir, timeout=5) as client:
        handle, fds = client.arena_fds()
    for fd in fds:
        os.close(fd)
    assert handle.transport == "memfd" and len(fds) == 1


FD_BAD_MESSAGES = {
    "unknown-op": framed(msgpack.packb({"v": PROTOCOL_VERSION, "op": "manifest"})),
    "wrong-version": framed(msgpack.packb({"v": 99, "op": "fds"})),
    "garbage": framed(b"\xc1\xc1 not msgpack"),
    "absurd-length": b"\xff\xff\xff\xff" + b"junk",
}


@pytest.mark.parametrize("kind", list(FD_BAD_MESSAGES))
def test_a_bad_fd_request_gets_an_error_reply_and_no_fds(kind, daemon):
    reply, fds = fd_exchange(daemon, FD_BAD_MESSAGES[kind])
    for fd in fds:
        os.close(fd)
    assert reply["ok"] is False and reply["error"]
    assert fds == []
    still_serves_fds(daemon)


def test_a_silent_client_on_the_fd_socket_does_not_hold_up_others(daemon):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(str(daemon.state_dir / "fds.sock"))  # ... and never says anything
        # Another worker attaching meanwhile is served at once (its timeout is well
        # below the daemon's patience with the silent one).
        with DaemonClient(daemon.state_dir, timeout=2) as client:
            _, fds = client.arena_fds()
        for fd in fds:
            os.close(fd)
        assert len(fds) == 1


def test_idle_connections_cost_no_thread_and_attaching_resumes(daemon):
    """A thousand connections that say nothing: the daemon keeps its threads (one serves
    both sockets, whatever connects), refuses those beyond what one process may hold,
    drops the rest after their moment, and a worker attaches again."""
    proc = psutil.Process(daemon.pid)
    threads = proc.num_threads()
    idle = []
    try:
        for _ in range(1000):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(daemon.state_dir / "fds.sock"))
            idle.append(s)
        time.sleep(0.5)
        assert proc.num_threads() <= threads + 2, (threads, proc.num_threads())
    finally:
        for s in idle:
            s.close()
    time.sleep(2.5)
    with DaemonClient(daemon.state_dir, timeout=5) as client:
        _, fds = client.arena_fds()
    for fd in fds:
        os.close(fd)
    assert len(fds) == 1


def memory(pid: int, key: str) -> int:
    """VmRSS, VmHWM (the peak RSS), ... of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) << 10
    raise KeyError(key)


def test_an_oversized_control_request_is_refused_as_its_length_arrives(daemon):
    """A request that says it is 100 MB long is refused as its length arrives (the peer
    told why and dropped), never taken in: the daemon's peak RSS, reset just before,
    grows by less than 10 MB. The daemon answers the next client."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sender:
        sender.settimeout(REPLY_TIMEOUT_MS / 1000)
        sender.connect(str(daemon.state_dir / "control.sock"))
        Path(f"/proc/{daemon.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS now
        peak = memory(daemon.pid, "VmHWM")
        try:
            sender.sendall(struct.pack("!I", 100 << 20) + b"\x00" * (100 << 20))
        except (BrokenPipeError, ConnectionResetError):
            pass  # (dropped mid-send, as it should be)
        reply, _ = recv_with_fds(sender, max_fds=0)
        assert reply["ok"] is False and f"exceeds {MAX_REQUEST}" in reply["error"], reply
        try:
            dropped = sender.recv(1 << 16) == b""
        except ConnectionResetError:  # (the kernel's word for "closed with your bytes unread")
            dropped = True
        assert dropped, "the peer was not dropped"
    time.sleep(0.2)
    assert memory(daemon.pid, "VmHWM") - peak < 10 << 20
    with DaemonClient(daemon.state_dir, timeout=5) as client:
        assert client.request("status")["status"]["state"] == "ready"


# ---- floods of connections ----------------------------------------------------------


FLOOD = 3000  # connections one process opens (issue 36's run: 10,500 raised the daemon's RSS by 476 MB)


def connect_many(path: Path, n: int) -> list[socket.socket]:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 256), hard))
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        out.append(s)
    return out


ATTACH_ELSEWHERE = """
import os, sys
from preload.ipc.client import DaemonClient
with DaemonClient(sys.argv[1], timeout=10) as client:
    state = client.request("status")["status"]["state"]
    _, fds = client.arena_fds()
print(state, len(fds))
"""


def attach_from_another_process(state_dir: Path) -> str:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", ATTACH_ELSEWHERE, str(state_dir)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("socket_name", ["control.sock", "fds.sock"])
def test_a_flood_of_connections_from_one_process_is_bounded(daemon, socket_name):
    """Issue 36: one process holds at most PER_PROCESS connections; the rest are told the
    daemon is busy and closed at once. While the flood holds its connections, another
    process is served at once (its workers and spares attach), the daemon's memory does
    not grow with the flood, and its log says so in a line or two, not one per
    connection (the flood of fds.sock once made the spares crash-loop and wrote 28 MB)."""
    log = daemon.state_dir / "daemon.log"
    log_before = log.stat().st_size
    rss, fds = memory(daemon.pid, "VmRSS"), psutil.Process(daemon.pid).num_fds()
    flood = connect_many(daemon.state_dir / socket_name, FLOOD)
    try:
        time.sleep(1.0)
        assert psutil.Process(daemon.pid).num_fds() - fds <= PER_PROCESS, "the daemon holds the flood's connections"
        assert attach_from_another_process(daemon.state_dir) == "ready 1"
        busy = []
        for s in flood[-5:]:  # (the last ones came over the limit: told why)
            s.settimeout(2)
            busy.append(recv_with_fds(s, max_fds=0)[0])
        assert all(b.get("busy") and f"{PER_PROCESS} connections of pid {os.getpid()}" in b["error"] for b in busy), busy
        assert memory(daemon.pid, "VmRSS") - rss < 20 << 20
    finally:
        for s in flood:
            s.close()
    time.sleep(0.5)
    said = log.read_bytes()[log_before:].decode().splitlines()
    assert len([line for line in said if "refused" in line]) <= 3, said[:10]  # (none if a flood just before was said)
    with DaemonClient(daemon.state_dir, timeout=5) as client:  # (and this process is served again)
        assert client.request("status")["status"]["state"] == "ready"


# ---- other uids ------------------------------------------------------------------


def ask_everything(state_dir: str) -> dict:
    """Runs as uid 65534: what does the daemon say on each socket?"""
    out = {"uid": os.getuid()}
    try:
        with DaemonClient(state_dir, timeout=5) as client:
            out["control"] = {"served": client.request("status")["status"]["state"]}
    except DaemonError as e:
        out["control"] = {"refused": str(e)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(os.path.join(state_dir, "fds.sock"))
        send_with_fds(sock, {"op": "fds"}, [])
        reply, fds = recv_with_fds(sock)
        out["fds"] = {"reply": reply, "fds": len(fds)}
        for fd in fds:
            os.close(fd)
    return out


def attach_and_read(state_dir: str) -> dict:
    """Runs as uid 65534: attach and touch every weight."""
    with attach(state_dir) as weights:
        total = sum(float(t.float().sum()) for t in weights.values())
        return {"uid": os.getuid(), "fingerprint": weights.fingerprint, "tensors": len(weights), "finite": total == total}


def close_to_others(state_dir: Path) -> None:
    os.chmod(state_dir, 0o700)
    for name in ("control.sock", "fds.sock"):
        os.chmod(state_dir / name, 0o600)


def test_a_client_of_another_uid_is_refused_on_both_sockets(daemon):
    errors = daemon.metrics()["preload_errors_total"]
    open_to_others(daemon.state_dir)
    try:
        seen = as_nobody(ask_everything, str(daemon.state_dir))
    finally:
        close_to_others(daemon.state_dir)
    assert seen.get("uid") == NOBODY, seen
    assert "refused" in seen["control"], seen
    assert str(NOBODY) in seen["control"]["refused"]
    assert seen["fds"]["reply"]["ok"] is False and seen["fds"]["reply"]["error"]
    assert seen["fds"]["fds"] == 0, "arena fds were handed to a refused uid"
    assert daemon.metrics()["preload_errors_total"] == errors + 2
    assert daemon.get("/health").status_code == 200


def hold_silent_connections(state_dir: str) -> dict:
    """Runs as uid 65534: 40 connections to the control socket that say nothing; how many
    the daemon closed within 3 s (a refused peer may not hold a slot for long)."""
    import time as clock

    socks = []
    for _ in range(40):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(os.path.join(state_dir, "control.sock"))
        s.settimeout(0.1)
        socks.append(s)
    clock.sleep(3.0)
    closed = 0
    for s in socks:
        try:
            while s.recv(1 << 16):  # (past what it was told, if anything: its end)
                pass
            closed += 1
        except TimeoutError:
            pass  # still open
        except OSError:
            closed += 1
        s.close()
    return {"uid": os.getuid(), "closed": closed}


def test_refused_peers_are_dropped_and_never_crowd_out_the_allowed(daemon):
    open_to_others(daemon.state_dir)
    try:
        seen = as_nobody(hold_silent_connections, str(daemon.state_dir))
    finally:
        close_to_others(daemon.state_dir)
    assert seen.get("uid") == NOBODY and seen["closed"] == 40, seen
    with DaemonClient(daemon.state_dir, timeout=5) as client:
        assert client.request("status")["status"]["state"] == "ready"


def test_an_allow_listed_uid_attaches(tiny_checkpoint, base_dir):
    with running_daemon(base_dir / "allow-state", tiny_checkpoint, "--allow-uid", NOBODY) as d:
        open_to_others(d.state_dir)
        got = as_nobody(attach_and_read, str(d.state_dir))
        assert got.get("uid") == NOBODY, got
        assert got["fingerprint"] == d.status()["fingerprint"]
        assert got["tensors"] > 0 and got["finite"]
        assert d.metrics()["preload_errors_total"] == 0


# ---- foreign peers on the control socket ------------------------------------------

FOREIGN_PEERS = {
    # ZMTP/1.0 (ZeroMQ's, which this socket once was): an empty identity frame, then one message.
    "zmtp-1.0": b"\x01\x00" + b"\x06\x00hello",
    "http": b"GET /status HTTP/1.0\r\n\r\n" + bytes(range(256)) * 2,
    "a-short-header-then-nothing": b"\x00\x00",
}


def test_foreign_peers_on_the_control_socket_do_not_take_it_down(tiny_checkpoint, tmp_path):
    """Its own daemon: a failure here must not cascade into the other tests."""
    with running_daemon(tmp_path / "state", tiny_checkpoint) as d:
        for kind, junk in FOREIGN_PEERS.items():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                raw.connect(str(d.state_dir / "control.sock"))
                raw.sendall(junk)
                time.sleep(0.5)  # let the daemon read it before anyone else speaks
                with DaemonClient(d.state_dir, timeout=REPLY_TIMEOUT_MS / 1000) as client:
                    assert client.request("status")["ok"] is True, f"after a {kind} peer, the daemon no longer answers"
            assert d.get("/health").status_code == 200


# ---- no pickle -------------------------------------------------------------------


def test_no_pickle_anywhere_in_the_product():
    """Nothing that unpickles (or pickles for another process to unpickle): not the
    pickle family, not torch.save/torch.load, not torch's tensor reductions."""
    root = Path(preload.__file__).parent
    pattern = re.compile(
        r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|_pickle)\b"
        r"|\b(c?pickle|dill|cloudpickle|_pickle)\.\w+"
        r"|\btorch\.(load|save)\s*\("
        r"|\b(reduce_tensor|rebuild_tensor|ForkingPickler)\b",
        re.M,
    )
    offenders = [
        f"{path.relative_to(root)}: {m.group(0).strip()}"
        for folder in ("preloadd", "worker", "ipc", "cli", "kernels", "bench")
        for path in sorted((root / folder).rglob("*.py"))
        for m in pattern.finditer(path.read_text())
    ]
    assert (root / "ipc" / "protocol.py").exists(), "searched the wrong tree"
    assert offenders == []


def test_the_default_state_dir_is_the_runtime_dir_then_run_for_root_then_a_private_dir_in_tmp(monkeypatch, tmp_path):
    """A user without XDG_RUNTIME_DIR gets a dir made as mkdtemp makes one, found again by
    owner and mode: another user's dir of the same pattern, a link, or one open to others
    is never taken, and a name squatted in advance cannot stop a start."""
    import stat
    import tempfile

    from preload.ipc.protocol import default_state_dir

    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert str(default_state_dir()) == "/run/user/1000/preload"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setattr("os.getuid", lambda: 0)
    assert str(default_state_dir()) == "/run/preload"

    root = os.geteuid() == 0  # (as root, the dirs are given to the uid pretended below)
    uid = 1234 if root else os.geteuid()
    monkeypatch.setattr("os.getuid", lambda: uid)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    looked = default_state_dir()
    assert looked == tmp_path / f"preload-{uid}-*" and list(tmp_path.iterdir()) == []  # looking makes nothing
    open_one, link = tmp_path / f"preload-{uid}-open", tmp_path / f"preload-{uid}-link"
    open_one.mkdir(mode=0o755)
    link.symlink_to(open_one)
    traps = [open_one, link]
    if root:  # (only root can make a dir that another uid owns)
        theirs = tmp_path / f"preload-{uid}-theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, uid + 1, -1)
        os.chown(open_one, uid, -1)
        traps.append(theirs)
    made = default_state_dir(create=True)
    assert made not in traps and made.parent == tmp_path and made.name.startswith(f"preload-{uid}-")
    if root:
        os.chown(made, uid, -1)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert default_state_dir() == made == default_state_dir(create=True)  # found again, not made twice


def test_a_message_larger_than_the_socket_buffer_arrives_whole_with_its_fds():
    """(A keeper's handover socket has a timeout, so one sendmsg takes only what fits in
    the buffer: the rest must follow, or the keeper waits for it forever.)"""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.settimeout(10)
    theirs.settimeout(10)
    big = {"v": PROTOCOL_VERSION, "manifest": ["tensor.%d" % i for i in range(300_000)]}  # ~3.5 MB
    r, w = os.pipe()
    got = {}

    def receive():
        got["msg"], got["fds"] = recv_with_fds(theirs)

    reader = threading.Thread(target=receive)
    reader.start()
    try:
        send_with_fds(ours, big, [r])
        reader.join(10)
        assert got["msg"] == big and len(got["fds"]) == 1
        os.write(w, b"x")
        assert os.read(got["fds"][0], 1) == b"x"  # the fd is the pipe we sent
    finally:
        for fd in [r, w, *got.get("fds", [])]:
            os.close(fd)
        ours.close()
        theirs.close()
