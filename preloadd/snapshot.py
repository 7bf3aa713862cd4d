"""Snapshots (experimental): a zygote whose imports are done, checkpointed with CRIU
(`preload snapshot DIR`) and restored by a later start (`preload start --restore DIR`)
instead of importing again.

Before a worker attaches, what its start waits for is the zygote's imports (torch, FastAPI,
the worker code): 1.6 s on the project's CPU machine, 4-6 s on an H200 host. A zygote has
touched no device and holds nothing of a daemon's but its control socket, so its image
serves every later start of the same code on a like host: taken once (an image build, a
first start), restored by each start after it.

How. A zygote launched to be dumped (`--park`) does its imports, lets go of what a later
host would not have (stdin, stdout and stderr go to /dev/null; its control socket is one
CRIU is told is external), says "parked" and stops itself. `criu dump` writes its image and
kills it. A restore hands CRIU a new control socket for the old one (--inherit-fd); the
daemon continues the process and sends it its state dir, its environment and its stderr;
it goes on as a zygote launched then would (zygote.park). Before a restore: the image is
ours alone (a restore runs it as our uid), of this install's code and packages (install.py),
taken with the same variables that the imports read and as many CPUs. Whatever stops a
restore (that, a host where `criu check` fails, a pid the image needs taken), the start
goes on with a zygote launched as usual, and its log and /status say why. CRIU gives a
process back its pid: one image, one restored zygote at a time (two daemons on one host
take a snapshot each); the pid is drawn near the top of the range (high_pid), which a
fresh host or container leaves free.

CRIU needs root (or CAP_CHECKPOINT_RESTORE) and a kernel it knows: Debian 12's CRIU 3.17
fails `criu check` on the project's machines ("vdso: Unexpected rt vDSO area bounds"), CRIU
4.2 built from source passes there. $PRELOAD_CRIU names the binary (default: criu on PATH).
Not yet: an initialized engine core (attached, kernels compiled, graphs captured), which on
a GPU also needs the driver's checkpoint; this image ends where a zygote's imports do.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from preload.ipc.devices import cuda_device_count
from preload.preloadd.install import code_version, packages_version
from preload.preloadd.state_dir import MULTIPROC_ENV
from preload.preloadd.zygote import WORKER_ENV, Zygote, environment, receive, send

CRIU_ENV = "PRELOAD_CRIU"  # the criu binary, if not the one on PATH
META = "snapshot.json"  # beside the image: what it was taken from
IMAGE = "zygote"  # the image's folder in a snapshot
CRIU_TIMEOUT = 60.0  # seconds for a criu command
PARK_TIMEOUT = 120.0  # seconds for a zygote's imports, up to its "parked"
# Variables read at the imports (thread pools, allocators, library paths): a restored zygote
# has what the snapshot's had, so a start whose differ must not take it. (Those a daemon
# sends its workers, WORKER_ENV, are read later: they come with the restore.)
IMPORT_ENV = re.compile(r"^(OMP_|MKL_|OPENBLAS_|GOMP_|KMP_|PYTORCH_|TORCH|CUDA_|NCCL_|TRITON_|PYTHON|LD_)")


class SnapshotError(Exception):
    """Why a snapshot cannot be taken or restored here."""


def criu_binary() -> str:
    path = os.environ.get(CRIU_ENV) or shutil.which("criu")
    if not path or not os.access(path, os.X_OK):
        raise SnapshotError(f"no criu here ({f'${CRIU_ENV}={path}' if path else 'none on PATH'}): a snapshot needs"
                            f" CRIU 4.x (https://criu.org), on PATH or named by ${CRIU_ENV}")
    return path


def criu_check(criu: str) -> None:
    """Raise with CRIU's own reason unless `criu check` passes on this host."""
    r = _criu([criu, "check"])
    if r.returncode != 0:
        raise SnapshotError(f"`{criu} check` fails on this host: {criu_reason(r.stdout + r.stderr)}")


def criu_reason(text: str) -> str:
    """CRIU's error lines, without their source locations (its log says more)."""
    errors = [m.group(1).strip() for m in re.finditer(r"Error \([^)]*\):\s*(.*)", text)]
    errors = [e for e in dict.fromkeys(errors) if not e.startswith("rlimit:")]  # (printed on success too)
    return "; ".join(errors[:4]) or (text.strip().splitlines() or ["no output"])[-1]


def import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if IMPORT_ENV.match(k) and k not in WORKER_ENV} | \
        {MULTIPROC_ENV: "set" if MULTIPROC_ENV in env else "unset"}  # (prometheus-client's choice at import)


def take(dest: Path) -> dict:
    """Launch a zygote, let it import, dump it into `dest` (new, or an empty folder); what
    snapshot.json says of it. Nothing is left at `dest` unless all of it worked. (No state
    dir: the zygote is titled with its work folder, which no daemon takes for one of its own.)"""
    criu = criu_binary()
    criu_check(criu)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise SnapshotError(f"{dest} exists and is not an empty folder")
    work = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    try:
        (work / IMAGE).mkdir(parents=True, mode=0o700)
        return _dump_zygote(criu, work, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _dump_zygote(criu: str, work: Path, dest: Path) -> dict:
    t0 = time.monotonic()
    high_pid()
    # On a GPU host its workers' zygote imports their Triton kernels too (its idle work): done before the dump.
    kernels = cuda_device_count() > 0
    z = Zygote(work, code_version(), park="kernels" if kernels else "imports")
    try:
        z.sock.settimeout(PARK_TIMEOUT)
        parked, _ = receive(z.sock)
        if not parked or not parked.get("parked"):
            raise SnapshotError(f"the zygote exited before its imports were done (status {z.proc.wait()})")
        _wait_stopped(parked["pid"])
        imported = time.monotonic() - t0
        r = _criu([criu, "dump", "-t", str(parked["pid"]), "-D", str(work / IMAGE), "-o", "dump.log",
                   "--external", f"unix[{parked['socket']}]"])
        if r.returncode != 0:
            raise SnapshotError(f"criu dump: {criu_reason(_log(work / IMAGE / 'dump.log'))}")
        z.proc.wait()
    finally:
        z.discard()
    meta = {"code_version": z.version, "packages_version": packages_version(), "pid": parked["pid"],
            "socket": parked["socket"], "kernels_imported": kernels, "python": sys.executable,
            "cpus": len(os.sched_getaffinity(0)), "import_env": import_env(environment(work)),
            "criu": _criu([criu, "--version"]).stdout.partition("Version:")[2].split("\n")[0].strip(),
            "taken": time.time(), "import_seconds": round(imported, 3),
            "dump_seconds": round(time.monotonic() - t0 - imported, 3),
            "image_bytes": sum(p.stat().st_size for p in (work / IMAGE).iterdir())}
    (work / META).write_text(json.dumps(meta, indent=1) + "\n")
    if dest.exists():
        dest.rmdir()
    work.rename(dest)
    return meta


def restore(src: Path, state_dir: Path) -> Zygote:
    """The zygote of snapshot `src`, running for `state_dir` (our child: call as the daemon,
    a subreaper, would); SnapshotError if it cannot be restored here."""
    from preload.preloadd.workers import become_subreaper

    meta = read_meta(src)
    env = environment(state_dir)
    _check_like(meta, env)
    criu = criu_binary()
    become_subreaper()  # (criu exits once it has restored: the zygote must come to us, not to init)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pidfile = state_dir / "restore.pid"
    pidfile.unlink(missing_ok=True)
    try:
        r = _criu([criu, "restore", "-D", str(src / IMAGE), "-W", str(state_dir), "-o", "criu-restore.log", "-d",
                   "--pidfile", str(pidfile), "--inherit-fd", f"fd[{theirs.fileno()}]:socket:[{meta['socket']}]"],
                  pass_fds=(theirs.fileno(),))
        theirs.close()
        if r.returncode != 0:
            raise SnapshotError(f"criu restore: {criu_reason(_log(state_dir / 'criu-restore.log'))}")
        pid = int(pidfile.read_text())
        try:
            os.kill(pid, signal.SIGCONT)  # (it stopped itself before the dump)
            send(ours, {"state_dir": str(state_dir), "env": env}, [sys.stderr.fileno()])
        except OSError as e:
            RestoredProcess(pid).kill()
            raise SnapshotError(f"the restored zygote (pid {pid}): {e}") from None
    except (OSError, ValueError) as e:  # (no pidfile, or not a pid: criu said it restored, but what?)
        ours.close()
        raise SnapshotError(f"criu restore: {e}") from None
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
        pidfile.unlink(missing_ok=True)
        (state_dir / "stats-restore").unlink(missing_ok=True)  # (CRIU's figures of it, in its work dir; its log stays)
    return Zygote.restored(RestoredProcess(pid), ours, meta["code_version"])


class RestoredProcess:
    """What is read of a zygote's process (as of a Popen: pid, poll, wait, kill, returncode)
    when CRIU restored it: not started by us, but our child once criu exited."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:  # (waitpid has no timeout: as Popen.wait does, poll)
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def read_meta(src: Path) -> dict:
    """snapshot.json of `src`, once `src` is found to be ours alone: its image is code we run."""
    for path in (src, src / IMAGE, *(src / IMAGE).glob("*"), src / META):
        try:
            st = path.lstat()
        except OSError as e:
            raise SnapshotError(f"{src} is not a snapshot (`preload snapshot DIR` makes one): {e.strerror}: {path}") from None
        if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022 or path.is_symlink():
            raise SnapshotError(f"{path} may be changed by others (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o},"
                                f" {'a link' if path.is_symlink() else 'not a link'}): a restore runs what it holds")
    try:
        meta = json.loads((src / META).read_text())
        meta["socket"], meta["code_version"] = int(meta["socket"]), str(meta["code_version"])
        return meta
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"{src / META}: {e}") from None


def _check_like(meta: dict, env: dict[str, str]) -> None:
    if meta["code_version"] != code_version():
        raise SnapshotError("the snapshot holds other code than this install's (taken before the code changed):"
                            " take it again with `preload snapshot DIR`")
    if meta.get("packages_version") != packages_version():
        raise SnapshotError("the installed packages (torch and the rest) are not those the snapshot imported:"
                            " take it again with `preload snapshot DIR`")
    if meta.get("python") != sys.executable:
        raise SnapshotError(f"the snapshot's Python is {meta.get('python')}, this daemon's {sys.executable}")
    cpus = len(os.sched_getaffinity(0))
    if meta.get("cpus") != cpus:
        raise SnapshotError(f"the snapshot was taken with {meta.get('cpus')} CPUs, this start has {cpus}"
                            " (torch sized its thread pool at the import)")
    ours, theirs = import_env(env), meta.get("import_env", {})
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        raise SnapshotError(f"variables the imports read differ from the snapshot's: {', '.join(differ)}")


def high_pid() -> None:
    """Have the next process made here get a pid near the top of the range (the kernel's
    ns_last_pid, which CRIU's own privileges let us write): a restore needs the image's pid
    free, and a fresh host or container hands out pids from the bottom. Without the
    privilege, the next pid as it comes."""
    try:
        top = int(Path("/proc/sys/kernel/pid_max").read_text())
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(top - 1 - random.randrange(min(4096, top // 4))))
    except (OSError, ValueError):
        pass


def _wait_stopped(pid: int) -> None:
    """Until `pid` has stopped itself (park): CRIU must find it so."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        time.sleep(0.005)
    raise SnapshotError(f"the parked zygote (pid {pid}) did not stop")


def _criu(args: list[str], pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=CRIU_TIMEOUT, pass_fds=pass_fds)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SnapshotError(f"{args[0]} {args[1]}: {e}") from None


def _log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError as e:
        return f"Error (-): no log at {path}: {e.strerror}"
