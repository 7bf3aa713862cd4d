"""Kernels compiled ahead: the list of Triton kernels a worker compiled, kept in the
kernel cache beside them, and compiled again from it where the kernels themselves are
missing (a new host, a new image, a cache emptied by an upgrade), in parallel and
without a GPU.

A worker's first start on a host with an empty kernel cache compiles every kernel its
warm-up meets, one after another (V2-Lite on the H200: ready in 17.9 s, 8.3 s with the
cache full). What the JIT compiles is decided by a few hundred bytes per kernel, which
Triton writes as JSON for its hooks ("specialization data": the kernel's module and name,
argument types, constexprs, alignment attributes, options, target). So:

- `record(cache_dir)`: in a worker, every kernel the JIT meets for the first time that
  the list does not hold yet is added to `preload-kernels.json` in the cache (under a
  lock, so workers sharing a cache add to one list). A start whose kernels are all listed
  writes nothing.
- `compile_list(entries)`: processes forked from this one (the kernel modules imported
  once, before the fork) compile their share into the kernel cache, as the JIT would at
  a first launch: the same cache key, so the JIT then finds them; and where the host can,
  the C host code that launch would build too (host_code.py). No GPU is needed, only
  the target each entry names: `preload kernels compile` runs it in an image build or an
  init container, from a list a GPU host recorded.

Only kernels of this package are compiled from a list (it names modules to import): a
list is data, never a way to run someone's code. An entry that does not compile (a
kernel changed since it was recorded) fails alone; the JIT compiles what it needs then.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import select
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from preload.kernels import host_code

log = logging.getLogger(__name__)

LIST_NAME = "preload-kernels.json"
PACKAGE = __name__.rpartition(".")[0]  # preload.kernels: the only modules a list may name
MAX_ENTRIES = 4096  # the oldest go first past it (a host that served many models and options)
COMPILE_AHEAD_TIMEOUT = 120.0  # seconds from their start that cores wait for kernels compiled ahead


def list_path(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir, LIST_NAME)


def read_list(path: str | os.PathLike) -> dict[str, str]:
    """The entries of a kernel list, {digest: specialization JSON}; {} where there is none.
    ValueError for a file that is not one."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    try:
        doc = json.loads(text)
        kernels = doc["kernels"]
        if not isinstance(kernels, dict) or not all(isinstance(v, str) for v in kernels.values()):
            raise TypeError("'kernels' is not a map of JSON strings")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a kernel list: {e}") from None
    return kernels


def entry_digest(spec: str) -> str:
    return hashlib.sha256(spec.encode()).hexdigest()[:24]


class Recorder:
    """Adds each kernel the JIT compiles in this process to the cache's list (install()),
    and counts the kernels this process compiled and those it found in the cache (so that a
    start's log says whether kernels compiled ahead were the ones its JIT looked for)."""

    def __init__(self, cache_dir: str | os.PathLike):
        self.path = list_path(cache_dir)
        try:
            self.known = set(read_list(self.path))
        except ValueError as e:
            log.warning("%s; written anew", e)
            self.known = set()
        self.added = 0
        self.compiled = self.found = 0
        self._target: dict | None = None
        self._before = self._listener = None

    def install(self) -> Recorder:
        from triton import knobs

        self._before = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self.hook
        if hasattr(knobs.compilation, "listener"):  # (a Triton without it: no counts)
            self._listener = knobs.compilation.listener
            knobs.compilation.listener = self.listen
        return self

    def uninstall(self) -> None:
        from triton import knobs

        if knobs.runtime.jit_cache_hook == self.hook:
            knobs.runtime.jit_cache_hook = self._before
        if getattr(knobs.compilation, "listener", None) == self.listen:
            knobs.compilation.listener = self._listener

    def listen(self, *, cache_hit: bool, **kwargs) -> None:
        """Triton's compilation listener: after each kernel compiled, or found in the cache."""
        if cache_hit:
            self.found += 1
        else:
            self.compiled += 1
        if self._listener:
            self._listener(cache_hit=cache_hit, **kwargs)

    def said(self) -> str:
        return (f"kernels this process: {self.compiled} compiled, {self.found} found in the cache, {self.added} new to"
                " the list")

    def hook(self, *, compile: dict, **kwargs) -> bool:
        """Triton's jit_cache_hook: called before the JIT compiles (or finds on disk) a kernel
        this process has not launched yet. Never skips the compile (unless a hook installed
        before this one says so)."""
        spec = compile.get("specialization_data")
        if spec is not None:
            try:
                self.add(self.with_target(spec))
            except Exception as e:  # noqa: BLE001 (a list not written costs a later start time, never this launch)
                log.warning("kernel list %s not updated: %s", self.path, e)
        return bool(self._before(compile=compile, **kwargs)) if self._before else False

    def with_target(self, spec: str) -> str:
        """The spec naming its target (Triton 3.6 leaves it out: this process's GPU's)."""
        d = json.loads(spec)
        if d.get("target"):
            return spec
        if self._target is None:
            from triton.runtime import driver

            t = driver.active.get_current_target()
            self._target = {"backend": t.backend, "arch": t.arch, "warp_size": t.warp_size}
        return json.dumps(d | {"target": self._target})

    def add(self, spec: str) -> None:
        digest = entry_digest(spec)
        if digest in self.known:
            return
        self.known.add(digest)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (workers sharing the cache: none loses another's entries)
            try:
                kernels = read_list(self.path)
            except ValueError:  # (damaged: said when this recorder began; written anew from here)
                kernels = {}
            kernels.pop(digest, None)
            kernels[digest] = spec
            write_list(self.path, dict(list(kernels.items())[-MAX_ENTRIES:]))
        self.added += 1


def write_list(path: Path, kernels: dict[str, str]) -> None:
    """Written whole to a temporary file renamed over the old: a reader sees one or the other."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernels-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"kernels": kernels}, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


_recording: Recorder | None = None


def recorded() -> str | None:
    """What this process's recorder counted (Recorder.said); None where none records."""
    return _recording.said() if _recording is not None else None


def record(cache_dir: str | os.PathLike | None = None) -> Recorder | None:
    """Record this process's kernels into the list in `cache_dir` (default: Triton's kernel
    cache, TRITON_CACHE_DIR); once per process. None where Triton is absent."""
    global _recording
    try:
        from triton import knobs
    except ImportError:
        return None
    path = list_path(cache_dir or knobs.cache.dir)
    if _recording is None or _recording.path != path:
        if _recording is not None:
            _recording.uninstall()
        _recording = Recorder(path.parent).install()
    return _recording


@dataclass(frozen=True)
class Compiled:
    kernels: int  # entries handed out
    failed: dict[str, str]  # {spec: "name: why"} for each entry that did not compile
    processes: int
    seconds: float
    host_code: str | None = None  # why Triton's launchers and driver helpers were not built with them (host_code.py)


def compile_list(specs: list[str], processes: int | None = None) -> Compiled:
    """Compile `specs` (specialization JSONs naming their targets) into the kernel cache
    (TRITON_CACHE_DIR as this process has it) in `processes` forked processes (default:
    the CPUs this one may use). Those already in the cache are found there, quickly."""
    t0 = time.monotonic()
    if not specs:
        return Compiled(0, {}, 0, 0.0)
    refused = {s: f"{name_of(s)}: not a kernel of {PACKAGE}" for s in specs if not ours(s)}
    specs = [s for s in specs if ours(s)]
    processes = max(1, min(len(specs), processes or len(os.sched_getaffinity(0))))
    for module in sorted({name_of(s).rpartition(".")[0] for s in specs}):
        try:  # (once, here: the forked processes start with them imported)
            importlib.import_module(module)
        except ImportError:
            pass  # (each of its entries fails alone, saying so)
    failed, why = dict(refused), host_code.unbuildable()
    context = multiprocessing.get_context("fork")  # (no CUDA here: compiling needs none)
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        futures = [pool.submit(compile_share, specs[part::processes], why is None, why is None and part == 0)
                   for part in range(processes)]
        for part, future in enumerate(futures):
            try:
                failed |= future.result()
            except Exception as e:  # noqa: BLE001 (a process that died: its share left to the JIT)
                failed |= {s: f"{name_of(s)}: {type(e).__name__}: {e}" for s in specs[part::processes]}
    done = Compiled(len(specs) + len(refused), failed, processes, time.monotonic() - t0, why)
    log.info("compiled %d kernels in %d processes in %.2f s (%d failed)%s", done.kernels, processes, done.seconds,
             len(failed), "" if why is None else f"; their launchers not built here: {why}")
    return done


def name_of(spec: str) -> str:
    try:
        return str(json.loads(spec)["name"])
    except (ValueError, KeyError, TypeError):
        return "(not a specialization)"


def compiled_marker(cache_dir: str | os.PathLike, specs: list[str]) -> Path:
    """A file in the cache whose existence says these specs were compiled into it, by this
    Triton and these kernel sources (a list changed, an upgrade: another name)."""
    import triton

    h = hashlib.sha256(f"{triton.__version__}\n".encode())
    for spec in sorted(specs):
        h.update(spec.encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        h.update(source.read_bytes())
    return Path(cache_dir, f"preload-compiled-{h.hexdigest()[:24]}")


def fork_compiles(specs: list[str], processes: int) -> tuple[list[int], int]:
    """Compile `specs` into the kernel cache in `processes` children forked now (without
    an executor's threads: for a process that forks workers, the zygote), each its share;
    a child exits 1 if any of its share failed (said on stderr). Their pids, and the read
    end of a pipe whose write end only they hold: at its EOF every one has exited."""
    pids, (ready, held), why = [], os.pipe(), host_code.unbuildable()
    for part in range(max(1, min(processes, len(specs)))):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                # What the forking process holds (a zygote: the API's listening socket, its channel to
                # the daemon) is not a compiler's: one that outlives it must not keep a port bound.
                os.closerange(3, held)
                os.closerange(held + 1, os.sysconf("SC_OPEN_MAX"))
                failed = compile_share(specs[part::processes], why is None, why is None and part == 0)
                for reason in failed.values():
                    print(f"kernel not compiled ahead: {reason}", file=sys.stderr)
                code = int(bool(failed))
            finally:
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    os.close(held)
    if why is not None:
        print(f"kernels compiled ahead without their launchers: {why}", file=sys.stderr)
    return pids, ready


def wait_compiles(pids: list[int], timeout: float) -> bool:
    """Wait up to `timeout` seconds for the children of fork_compiles; True if every one
    exited 0 in time. Those still running then are killed (the JIT compiles what they had
    left) and reaped: none is left behind."""
    deadline, ok = time.monotonic() + timeout, True
    for pid in pids:
        while not (reaped := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        if not reaped[0]:
            os.kill(pid, signal.SIGKILL)
            reaped = os.waitpid(pid, 0)
        ok = ok and os.waitstatus_to_exitcode(reaped[1]) == 0  # (a killed one: -9)
    return ok


@dataclass
class Compiling:
    """Kernels being compiled ahead by forked children (compile_listed). The process that
    forked them goes on forking workers meanwhile (a zygote must answer a fork within
    seconds): each worker gets `handed()`, and a core waits in `wait_compiled` until they
    are done or COMPILE_AHEAD_TIMEOUT has passed since they began."""

    pids: list[int]
    marker: Path
    ready_fd: int  # EOF once every child has exited (fork_compiles)
    started: float = field(default_factory=time.monotonic)

    def finish(self, timeout: float) -> bool:
        """Wait for them (up to `timeout` seconds from their start); mark the cache done if
        all compiled; say how it went on stderr (a zygote's log)."""
        done = wait_compiles(self.pids, max(0.0, self.started + timeout - time.monotonic()))
        os.close(self.ready_fd)
        if done:
            self.marker.touch()
        print(f"kernels compiled ahead in {len(self.pids)} processes in {time.monotonic() - self.started:.2f} s"
              + ("" if done else " (not all: the JIT compiles the rest)"), file=sys.stderr)
        return done

    def settled(self) -> bool:
        """Without waiting: True once every child has exited or the time is up (then
        finished: reaped, the cache marked if all compiled), else False."""
        if select.select([self.ready_fd], [], [], 0)[0] or time.monotonic() > self.started + COMPILE_AHEAD_TIMEOUT:
            self.finish(COMPILE_AHEAD_TIMEOUT)
            return True
        return False

    def settled_unless_asked(self, sock) -> bool:
        """Wait until they settle (as `settled`) unless `sock` becomes readable first (the
        zygote's next fork request, or the daemon gone): True once settled. So a zygote that
        forks no other worker meanwhile still reaps them, marks the cache and says so."""
        select.select([sock, self.ready_fd], [], [], max(0.0, self.started + COMPILE_AHEAD_TIMEOUT - time.monotonic()))
        return self.settled()

    def handed(self) -> dict:
        """What a worker forked meanwhile is told (its spec's "compiles"): wait_compiled."""
        return {"compiles": [self.ready_fd, self.started + COMPILE_AHEAD_TIMEOUT]}


def wait_compiled(spec: dict) -> None:
    """In a worker forked while kernels compiled ahead: a core waits for them (its first
    step then finds them in the cache), up to the deadline; any role closes the pipe."""
    if "compiles" not in spec:
        return
    fd, until = spec["compiles"]
    try:
        if spec.get("role", "core") == "core":
            select.select([fd], [], [], max(0.0, until - time.monotonic()))  # (CLOCK_MONOTONIC: one clock on the host)
    finally:
        os.close(fd)


def compile_listed() -> Compiling | None:
    """The kernels the cache's own list names, compiled now in children forked from this
    process (one per CPU it may use), unless the cache has them all already (its marker
    for this list, Triton and these sources). For a zygote on a host whose kernel cache is
    empty or outdated (a new Triton, changed kernels) but whose list came along (an
    image, a volume, an earlier version's start): they compile in parallel while the
    daemon loads, not one after another in the first worker's warm-up. None: nothing to do."""
    from triton import knobs

    from preload.kernels import triton_import_steps

    try:
        specs = list(read_list(list_path(knobs.cache.dir)).values())
        marker = compiled_marker(knobs.cache.dir, specs) if specs else None
        if marker is None or marker.exists():
            return None
        for step in triton_import_steps():  # (the children start with the kernel modules imported)
            step()
    except Exception as e:  # noqa: BLE001 (nothing compiled ahead: the JIT compiles at first use, and says a real fault)
        print(f"kernels not compiled ahead: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    pids, ready = fork_compiles(specs, len(os.sched_getaffinity(0)))
    return Compiling(pids, marker, ready)


def ours(spec: str) -> bool:
    return name_of(spec).startswith(PACKAGE + ".")


def compile_share(specs: list[str], launchers: bool = False, helpers: bool = False) -> dict[str, str]:
    """In a forked process: compile each spec (and build its launcher, and first Triton's
    driver helpers: host_code.py); {spec: "name: why"} for those that failed."""
    if helpers:
        try:
            host_code.build_driver_helpers()
        except Exception as e:  # noqa: BLE001 (a first launch builds them, and says a real fault)
            print(f"Triton's driver helpers not built ahead: {type(e).__name__}: {e}"[:500], file=sys.stderr)
    failed = {}
    for spec in specs:
        try:
            compile_spec(spec, launchers)
        except Exception as e:  # noqa: BLE001 (the JIT compiles it at its first launch, and says a real fault)
            failed[spec] = f"{name_of(spec)}: {type(e).__name__}: {e}"[:500]
    return failed


def compile_spec(spec: str, launcher: bool = False) -> None:
    """Compile one specialization JSON into the kernel cache as the JIT would at the
    kernel's first launch (the same source, signature, constexprs, attributes, options
    and target: the same cache key); with `launcher`, build its launcher as that launch
    would (host_code.py)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.autotuner import Autotuner, Heuristics

    if not ours(spec):  # (a list is data: it names modules to import, so only ours, whoever calls)
        raise ValueError(f"{name_of(spec)} is not a kernel of {PACKAGE}: not compiled")
    d = json.loads(spec)
    if not d.get("target"):
        raise ValueError("no target named")
    module, _, name = d["name"].rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    while isinstance(fn, (Autotuner, Heuristics)):  # (the JIT function they wrap)
        fn = fn.fn

    def value(v):
        if isinstance(v, str) and tl.dtype.is_dtype(v):
            return tl.dtype(v)
        if isinstance(v, dict) and "constexpr" in v:
            return tl.constexpr(tupled(v["constexpr"]))
        if isinstance(v, dict):
            raise ValueError(f"a constexpr of another kind ({v}) is not compiled ahead")
        return tupled(v)

    constexprs = {tuple(k): value(v) for k, v in zip(d["constant_keys"], d["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(d["attrs_keys"], d["attrs_vals"])}
    signature = {k: tupled(v) for k, v in d["signature"].items()}
    # (libdevice's path on the recording host: here Triton fills in its own, which the cache key
    # hashes by content, so a list recorded under another install compiles to the same keys)
    options = {k: tupled(v) for k, v in d["options"].items() if k != "extern_libs"}
    src = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton.compile(src, target=GPUTarget(**d["target"]), options=options)
    if launcher and d["target"]["backend"] == "cuda":
        host_code.build_launcher(src, kernel.metadata)


def tupled(v):
    """JSON's lists as the tuples they were (a kernel's signature takes no lists)."""
    return tuple(tupled(x) for x in v) if isinstance(v, list) else v
