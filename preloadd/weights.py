"""The daemon's weights as it holds them, however they came: loaded from the checkpoint
(preloadd/loader.py) or taken back from the keeper a crashed daemon left (preloadd/keeper.py).

Here: a load's progress, what a load or a take-back yields, and the check that weights a
keeper kept are what this daemon would load. Nothing here imports torch: a daemon that
re-adopts is to be ready in about a second, and `import torch` alone takes 4-6 s on a GPU
host (unless a checkpoint file changed on disk since: then its tensors are hashed again).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from preload.checkpoint.identity import IdentityError, fingerprint, verify_checkpoint
from preload.ipc.manifest import Manifest
from preload.ipc.protocol import ProtocolError


class LoadError(RuntimeError):
    pass


class LoadCancelled(LoadError):
    """The daemon was told to stop while it loaded: the loader threads end at their next chunk."""


# read: pages mapped in; hash: the one pass over each source tensor, chunk by chunk: hashed,
# checked for NaN and Inf, and (stored as read) copied in, which preloadd/copy_loader.py times
# apart as write (host) or upload (GPU); upload, quantize and write: the rest's way in.
STAGES = ("plan", "read", "hash", "upload", "quantize", "write", "publish")


@dataclass
class Progress:
    """A load's progress, and where its time went: `stages` holds seconds per stage,
    summed over the loader's threads (read, hash, upload, quantize and write run
    in several at once, so they add up to more than the wall clock; plan and publish are
    the wall clock's own)."""

    total_bytes: int = 0
    done_bytes: int = 0
    tensors_total: int = 0
    tensors_done: int = 0
    started: float = field(default_factory=time.monotonic)
    seconds: float | None = None  # set once loaded
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False)  # set by a stop mid-load
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def check(self) -> None:
        """Raise LoadCancelled once the load is cancelled: each loader thread asks between
        chunks, so that a stop during a load ends it within a chunk's time (a pool waits for
        the tensors in flight, which were read to the end before: 7-19 s on a cold disk)."""
        if self.cancelled.is_set():
            raise LoadCancelled("the load was cancelled: the daemon is stopping")

    @contextmanager
    def timed(self, stage: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add({stage: time.perf_counter() - t})

    def add(self, seconds: dict[str, float]) -> None:
        """Seconds a thread spent per stage, timed by itself."""
        with self._lock:
            for stage, s in seconds.items():
                self.stages[stage] += s

    def as_dict(self) -> dict:
        return {
            "total_bytes": self.total_bytes,
            "done_bytes": self.done_bytes,
            "tensors_total": self.tensors_total,
            "tensors_done": self.tensors_done,
            "fraction": self.done_bytes / self.total_bytes if self.total_bytes else 0.0,
            "stage_seconds": dict(self.stages),
        }


@dataclass
class Loaded:
    arena: object
    manifest: Manifest


def kept_manifest(wire: dict, model_dir: Path, quant: str, dtype: str, device: str, transport: str) -> Manifest:
    """The manifest of weights a keeper holds, if they are what this daemon would load:
    the same checkpoint (unchanged on disk, as attaching checks it), quant, dtype, device
    and transport, and a fingerprint that its record reproduces. LoadError says why not."""
    try:
        m = Manifest.from_wire(wire)
    except ProtocolError as e:
        raise LoadError(f"a malformed manifest ({e})") from None
    want = {"model": str(model_dir), "quant": quant, "dtype": dtype, "device": device}
    for key, value in want.items():
        if getattr(m, key) != value:
            raise LoadError(f"{key} {getattr(m, key)}, not {value}")
    if m.arena.transport != transport:
        raise LoadError(f"transport {m.arena.transport}, not {transport}")
    digests = {name: d for f in m.record.files.values() for name, d in f.tensors.items()}
    if fingerprint(m.record.aux, digests, {"quant": m.quant, "dtype": m.dtype}) != m.fingerprint:
        raise LoadError("a manifest whose fingerprint its record does not reproduce")
    try:
        verify_checkpoint(model_dir, m.record)
    except IdentityError as e:
        raise LoadError(f"another checkpoint than {model_dir} holds now ({e})") from None
    return m
