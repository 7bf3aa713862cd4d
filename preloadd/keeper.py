"""The keeper: a small process, without CUDA or torch, that holds the weights' arena fds
and the API listening socket so that they outlive the daemon.

The daemon starts one as its load begins and, once loaded, hands it the arena's fds, the
manifest and the API socket (over a socketpair, SCM_RIGHTS). While the daemon lives, that
connection is the keeper's owner; a clean stop sends {"op": "exit"} and the keeper exits,
letting go of the weights. If the daemon dies instead, the connection just closes: the
keeper keeps holding, and listens on <state dir>/keeper.sock (0600, our uid only) for the
next daemon of that state dir, which takes everything back ({"op": "take"}) without
reading the checkpoint, and becomes its owner. The API socket is never closed meanwhile,
so clients queue in its backlog (or are served by the workers the dead daemon left). If
the daemon ends before its load is done, its keeper exits, having held nothing.

The kept memory is what the fds keep: a sealed memfd, or a cuda-vmm allocation (its
exported fd keeps it alive). cuda-ipc handles die with their process: nothing to keep.

    python -m preload.preloadd.keeper STATE_DIR FD
"""

from __future__ import annotations

import logging
import os
import select
import selectors
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from preload.ipc.protocol import ProtocolError, open_log, peer_credentials, recv_with_fds, send_with_fds

log = logging.getLogger("preload.keeper")

KEEPER_SOCK = "keeper.sock"
HANDOVER_TIMEOUT = 10.0  # seconds for either side of a handover to answer
SCM_MAX_FD = 253  # Linux's most fds in one message: every copy's arena fds and the API socket


@dataclass
class Kept:
    """What a keeper holds: each copy's manifest (wire form) and arena fds (one copy a
    data-parallel rank, --data-parallel-size), the API socket."""

    manifests: list[dict]
    arena_fds: list[list[int]]
    api: socket.socket | None

    def close(self) -> None:
        for fd in [fd for fds in self.arena_fds for fd in fds]:
            os.close(fd)
        self.arena_fds = []
        if self.api is not None:
            self.api.close()
            self.api = None


def _send(sock: socket.socket, kept: Kept, **msg) -> None:
    fds = [fd for copy in kept.arena_fds for fd in copy] + ([kept.api.fileno()] if kept.api is not None else [])
    send_with_fds(sock, {**msg, "manifests": kept.manifests, "arena_fds": [len(copy) for copy in kept.arena_fds],
                         "api": kept.api is not None}, fds)


def _receive(sock: socket.socket) -> Kept:
    msg, fds = recv_with_fds(sock, max_fds=SCM_MAX_FD)
    if isinstance(msg.get("manifest"), dict) and isinstance(msg.get("arena_fds"), int):  # (a keeper of one copy, as
        msg = msg | {"manifests": [msg["manifest"]], "arena_fds": [msg["arena_fds"]]}  # before data parallelism)
    counts, manifests = msg.get("arena_fds"), msg.get("manifests")
    if (not isinstance(counts, list) or not all(isinstance(n, int) and n >= 0 for n in counts)
            or not isinstance(manifests, list) or len(manifests) != len(counts)
            or not all(isinstance(m, dict) for m in manifests) or len(fds) != sum(counts) + bool(msg.get("api"))):
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"malformed handover: {msg.get('error') or sorted(msg)}")
    starts = [sum(counts[:i]) for i in range(len(counts) + 1)]
    return Kept(manifests, [fds[a:b] for a, b in zip(starts, starts[1:])],
                socket.socket(fileno=fds[starts[-1]]) if msg["api"] else None)


# ---- the daemon's side ---------------------------------------------------------------------------


class KeeperLink:
    """The daemon's connection to its keeper: the keeper holds on as long as this is open
    and exits when told to (`release`)."""

    def __init__(self, sock: socket.socket, pid: int, empty: bool = False):
        self.sock, self.pid = sock, pid
        self.empty = empty  # spawned, not given the weights yet
        self._handover: threading.Thread | None = None
        self._pidfd = os.pidfd_open(pid)  # (a keeper taken over is not our child: its pidfd says when it is gone)

    @classmethod
    def spawn(cls, state_dir: Path) -> KeeperLink:
        """Start a keeper, to be given the weights once they are loaded (`give`): launched
        before the load, its interpreter's start (0.15 s on the 2-core CPU machine) is no
        longer a wait between the load and ready."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        import subprocess

        try:
            with os.fdopen(open_log(Path(state_dir) / "keeper.log"), "ab", buffering=0) as out:
                proc = subprocess.Popen([sys.executable, "-m", "preload.preloadd.keeper", str(state_dir),
                                         str(theirs.fileno())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=out,
                                        start_new_session=True)  # not in the daemon's process group: a ^C is the daemon's
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(ours, proc.pid, empty=True)

    def give(self, kept: Kept) -> None:
        """Hand `kept` to a keeper we spawned (the caller keeps its own fds), in a thread:
        `wait_kept` says when it holds them."""
        self.empty = False

        def handover() -> None:
            try:
                self.sock.settimeout(HANDOVER_TIMEOUT)
                _send(self.sock, kept, op="keep")
                self.sock.recv(1)  # its listening socket is bound
                self.sock.settimeout(None)
            except OSError as e:
                log.error("the keeper (pid %d) did not take the weights: %s; a crash of this daemon loses them", self.pid, e)

        self._handover = threading.Thread(target=handover, name="keeper-handover", daemon=True)
        self._handover.start()

    def dead(self) -> bool:
        """Whether the keeper has exited (killed, crashed): what it held is gone from it."""
        return bool(select.select([self._pidfd], [], [], 0)[0])

    def forget(self) -> None:
        """Close what we hold of a dead keeper (reaping it if it was our child)."""
        self.sock.close()
        os.close(self._pidfd)
        try:
            os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pass

    def wait_kept(self) -> None:
        """Until the keeper holds what it was given (a daemon is crash-safe from then on)."""
        if self._handover is not None:
            self._handover.join(HANDOVER_TIMEOUT)

    def release(self) -> None:
        """Tell the keeper to let go and exit (a clean stop; one never given the weights
        exits when its socket closes)."""
        self.wait_kept()
        try:
            if not self.empty:
                send_with_fds(self.sock, {"op": "exit"}, [])
        except OSError:
            pass  # gone already
        self.sock.close()
        # Gone before we are: a stop leaves no keeper and no keeper.sock behind.
        if not select.select([self._pidfd], [], [], HANDOVER_TIMEOUT)[0]:
            log.error("the keeper (pid %d) did not exit; killing it", self.pid)
            os.kill(self.pid, signal.SIGKILL)
        os.close(self._pidfd)
        try:
            os.waitpid(self.pid, os.WNOHANG)  # our child (spawned), else not ours to reap
        except ChildProcessError:
            pass


def take(state_dir: Path) -> tuple[KeeperLink, Kept] | None:
    """What a keeper of `state_dir` holds, if one lives; we become its owner. None if
    there is none (a stale socket is removed)."""
    path = Path(state_dir) / KEEPER_SOCK
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HANDOVER_TIMEOUT)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        path.unlink(missing_ok=True)  # a keeper that died (we hold the state dir's lock: no one else binds it)
        return None
    try:
        pid, uid, _ = peer_credentials(sock)
        if uid != os.getuid():
            raise ProtocolError(f"{path} is served by uid {uid}, not ours")
        send_with_fds(sock, {"op": "take"}, [])
        kept = _receive(sock)
    except (OSError, ProtocolError):
        sock.close()
        raise
    sock.settimeout(None)
    return KeeperLink(sock, pid), kept


# ---- the keeper process --------------------------------------------------------------------------


def _bind(path: Path) -> tuple[socket.socket, int]:
    path.unlink(missing_ok=True)
    old = os.umask(0o177)  # born 0600: no moment in which another user could connect
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(4)
    return listener, os.stat(path).st_ino


def _serve(state_dir: Path, owner: socket.socket | None, kept: Kept) -> None:
    path = state_dir / KEEPER_SOCK
    listener, inode = _bind(path)
    if owner is not None:
        owner.send(b"k")
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    if owner is not None:
        sel.register(owner, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    if _hand_over(conn, owner, kept):
                        owner = conn
                        sel.register(owner, selectors.EVENT_READ)
                    continue
                try:
                    msg, fds = recv_with_fds(owner)
                except (OSError, ProtocolError):  # EOF: the daemon died; hold on for the next one
                    log.warning("the daemon is gone; holding the weights for the next one on %s", state_dir)
                    sel.unregister(owner)
                    owner.close()
                    owner = None
                    continue
                for fd in fds:
                    os.close(fd)
                if msg.get("op") == "exit":
                    log.info("released by the daemon; exiting")
                    return
    finally:
        # A successor keeper may have bound the path since: remove only our own socket.
        try:
            if os.stat(path).st_ino == inode:
                path.unlink()
        except FileNotFoundError:
            pass


def _hand_over(conn: socket.socket, owner: socket.socket | None, kept: Kept) -> bool:
    """Serve one `take`: True if `conn` is now the owner."""
    conn.settimeout(HANDOVER_TIMEOUT)
    try:
        pid, uid, _ = peer_credentials(conn)
        if uid != os.getuid():
            log.warning("refused pid %d of uid %d", pid, uid)
        elif owner is not None:
            send_with_fds(conn, {"error": "held by a live daemon"}, [])
        elif recv_with_fds(conn)[0].get("op") == "take":
            _send(conn, kept)
            conn.settimeout(None)
            log.info("handed the weights to pid %d", pid)
            return True
    except (OSError, ProtocolError) as e:
        log.warning("handover failed: %s", e)
    conn.close()
    return False


def main(argv: list[str]) -> int:
    state_dir, fd = Path(argv[0]), int(argv[1])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s keeper %(levelname)s %(message)s")
    try:
        from setproctitle import setproctitle

        setproctitle(f"preload keeper --state-dir {state_dir}")  # how `preload status` and `stop` find it
    except ImportError:
        pass
    owner = socket.socket(fileno=fd)
    # (No timeout: the daemon spawns us before its load, which may take minutes.)
    try:
        if not owner.recv(1, socket.MSG_PEEK):
            log.info("the daemon stopped before it had weights to keep; exiting")
            return 0
        kept = _receive(owner)
    except (OSError, ProtocolError) as e:
        log.error("no weights handed over: %s", e)
        return 1
    log.info("holding %d arena fds of %d copies%s for %s", sum(map(len, kept.arena_fds)), len(kept.arena_fds),
             " and the API socket" if kept.api else "", state_dir)
    _serve(state_dir, owner, kept)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
