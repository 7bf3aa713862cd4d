"""The daemon's state dir and its locks: one daemon per state dir, one per GPU.
(No torch here: `preload stop` reads the lock.)"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


class StateDirError(RuntimeError):
    """The state dir or a device is not ours to use."""


MAX_SYMLINKS = 40  # as the kernel's ELOOP limit
METRICS_DIR = "metrics"  # in the state dir: the workers' metrics, one file per process
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's: where the workers write their series
KERNEL_CACHE_ENV = "TRITON_CACHE_DIR"  # Triton's: where the workers keep their compiled kernels


def prepare_state_dir(path: Path, others_allowed: bool, what: str = "state dir") -> None:
    """Create the state dir, or check that an existing one is ours and writable by nobody
    else (then made 0700, or 0711 (others may reach the sockets, not list the dir) when
    other uids or gids are allow-listed): one that others could write is refused, not
    chmod'ed, since what they may have put in it stays.
    Trusted only if nobody else could have made, replaced or redirected it, as ssh's
    StrictModes has it: the dir itself no symlink and ours; every directory above it root's
    or ours and writable by no one else (unless sticky, as /tmp is); no symlink on the way
    but root's (/var/run -> /run), and then what it points to passes the same checks.
    Everything that exists is checked before anything is made; missing directories are
    made 0700 one at a time, each checked (never followed) before the next. `what` names
    the dir in the refusals (the workers' kernel cache is held to the same checks)."""
    path = Path(os.path.abspath(path))
    if path == path.parent:
        raise StateDirError(f"{what} {path} is the root directory")
    parent_fd = _open_trusted_dir(path.parent, create=True, what=what)
    try:
        try:
            os.mkdir(path.name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        try:  # the dir itself, never what a symlink there points to
            fd = os.open(path.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        except OSError as e:
            raise StateDirError(f"{what} {path} is not a directory of ours (a symlink or a file: {e.strerror})") from None
    finally:
        os.close(parent_fd)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise StateDirError(f"{what} {path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()})")
        if st.st_mode & 0o022:  # (as ssh's StrictModes: a chmod now would not undo what is already in it)
            who = "its group" if st.st_mode & 0o020 else "others"
            raise StateDirError(
                f"{what} {path} is writable by {who} (mode {st.st_mode & 0o7777:o}): anything in it, a link that"
                f" redirects a log or a cleanup, could have been planted. Check its contents, then chmod 700 it;"
                f" or give a new dir")
        os.fchmod(fd, 0o711 if others_allowed else 0o700)
    finally:
        os.close(fd)


def kernel_cache_dir(state_dir: Path) -> Path:
    """Where the workers keep the Triton kernels they compile: the operator's
    $TRITON_CACHE_DIR if set; else $XDG_CACHE_HOME/preload/kernels (~/.cache/...), which
    outlives the state dir (under /run: gone at a reboot), so that only a machine's first
    start compiles (V2-Lite on the H200: 24 s of a worker's start, 2.5 s with its kernels
    cached). What is in it is code the workers run, so it is held to the state dir's checks;
    where it cannot pass them (no home, or not ours), the state dir's own, said in the log."""
    if os.environ.get(KERNEL_CACHE_ENV):
        return Path(os.environ[KERNEL_CACHE_ENV])
    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "preload", "kernels")
    try:
        prepare_state_dir(path, others_allowed=False, what="kernel cache")
        return path
    except (StateDirError, OSError, RuntimeError) as e:  # (RuntimeError: Path.home() with no home)
        log.warning("workers compile their kernels into the state dir, lost with it: %s", e)
        return state_dir / "triton"


def check_ancestors(directory: Path) -> None:
    """StateDirError unless `directory` and every directory above it is root's or ours and
    writable by no one else (a sticky one, like /tmp, lets others write but not replace
    ours), and any symlink on the way is root's and leads to such directories only."""
    os.close(_open_trusted_dir(Path(os.path.abspath(directory)), create=False, what="state dir"))


def _open_trusted_dir(directory: Path, create: bool, what: str) -> int:
    """An O_PATH fd of `directory` (absolute), walked from / one component at a time with
    lstat and O_NOFOLLOW, so that what is checked is what is used: each directory must pass
    `_check_dir`; a symlink must be root's, and its target is walked the same way. With
    `create`, a missing component is made (0700) once all that exists above it passed,
    then checked like the others (someone else's made first under our feet is refused)."""
    uid = os.getuid()
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    pending = list(reversed(directory.parts[1:]))  # the components still to walk, next last
    dirs: list[tuple[Path, int]] = []  # the walked directories, / first, each held open
    via = ""  # the last symlink followed, for the messages
    links = 0
    try:
        root = os.open("/", flags)
        dirs.append((Path("/"), root))
        _check_dir(Path("/"), os.fstat(root), uid, via, what)
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            here, fd = dirs[-1]
            if name == "..":
                if len(dirs) > 1:
                    os.close(dirs.pop()[1])
                continue
            path = here / name
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise StateDirError(f"{path}, above the {what}, does not exist{via}") from None
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass  # someone was quicker: checked below like anything else
                st = None
            except OSError as e:
                raise StateDirError(f"{path}, above the {what}, cannot be checked ({e.strerror}){via}") from None
            if st is not None and stat.S_ISLNK(st.st_mode):
                if st.st_uid != 0:
                    raise StateDirError(f"{path}, above the {what}, is a symlink of uid {st.st_uid}{via}: only root's"
                                        f" are followed (whoever made it could redirect the {what})")
                links += 1
                if links > MAX_SYMLINKS:
                    raise StateDirError(f"{path}, above the {what}: too many levels of symlinks")
                target = os.readlink(name, dir_fd=fd)
                via = f" (reached through the symlink {path} -> {target})"
                if target.startswith("/"):
                    while len(dirs) > 1:
                        os.close(dirs.pop()[1])
                pending.extend(reversed(Path(target).parts[1 if target.startswith("/") else 0:]))
                continue
            try:  # never through a symlink put there since the lstat
                child = os.open(name, flags, dir_fd=fd)
            except OSError as e:
                raise StateDirError(f"{path}, above the {what}, is not a directory ({e.strerror}){via}") from None
            dirs.append((path, child))
            _check_dir(path, os.fstat(child), uid, via, what)
        return dirs.pop()[1]
    finally:
        for _, fd in dirs:
            os.close(fd)


def _check_dir(path: Path, st: os.stat_result, uid: int, via: str, what: str) -> None:
    """Root's or ours, and writable by no one else unless sticky (as /tmp: others may add
    names there, not rename or remove ours)."""
    if st.st_uid not in (0, uid):
        raise StateDirError(f"{path}, above the {what}, belongs to uid {st.st_uid}{via}:"
                            f" they could replace the {what}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise StateDirError(f"{path}, above the {what}, is writable by others{via}: they could replace the {what}")


class PidLock:
    """An flock on a file holding the owner's pid; the kernel drops it when the owner
    dies, however it dies. `what` names the resource in the refusal."""

    def __init__(self, path: Path, what: str):
        self.path = path
        try:
            # (never through a symlink someone planted: it would make us truncate its target)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except PermissionError:
            raise StateDirError(f"{what} is in use by another user's preload daemon ({path})") from None
        except OSError as e:
            raise StateDirError(f"{what}: lock file {path} is not a regular file ({e.strerror})") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode().strip() or "?"
            os.close(self.fd)
            raise StateDirError(f"another preload daemon (pid {holder}) is running on {what}") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        os.ftruncate(self.fd, 0)
        os.close(self.fd)


def lock_holder(path: Path) -> int | None:
    """The pid in a daemon lock file while a live daemon holds the lock, else None. Only
    a regular file of ours is read (not a symlink, not one another user planted)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except (FileNotFoundError, OSError):
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text.isdigit() else None
    finally:
        os.close(fd)


def device_lock(device: str, uuid: str) -> PidLock:
    """One daemon per GPU, known by its UUID whatever CUDA_VISIBLE_DEVICES says."""
    return PidLock(Path(tempfile.gettempdir()) / f"preload-gpu-{uuid}.lock", f"device {device} (GPU {uuid})")


DAEMON_FILE = "daemon.json"  # the running daemon's pid and bound ports, for `preload status`


def write_private_json(path: Path, data: dict) -> None:
    """`data` as JSON at `path`, readable by its owner only, replaced atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
