"""What the daemon holds, exactly: a fingerprint over every weight's bytes.

While loading, the daemon hashes each tensor as read (the bytes pass through
anyway), and records per checkpoint file its identity on disk (device, inode, size,
mtime) next to the digests of the tensors it read from it. A client naming a model
directory is checked against that record: files with the same identity are trusted
without being read again (restarts stay fast); any other file is re-hashed, so a
copy is accepted and a checkpoint that differs in a single value is refused.

The hash is BLAKE3 (FORMAT 2; format 1 was SHA-256): as collision-resistant for identity,
several times faster, and parallel within a tensor. Records carry their format, and one
of another format is refused, never compared.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from blake3 import blake3

from preload.checkpoint.config import ModelConfig
from preload.checkpoint.tokenizer import TOKENIZER_FILES

if TYPE_CHECKING:  # (imported where tensors are read: a daemon that re-adopts checks a record without torch)
    import torch

AUX_FILES = ("config.json", *TOKENIZER_FILES)
FORMAT = 2  # of digests, records and fingerprints
CHUNK_BYTES = 1 << 23  # hashed at a time (1 MiB chunks loaded V2-Lite on the H200 2.8x slower: per-chunk costs)


class IdentityError(ValueError):
    """The model a client asked for is not the one the daemon holds."""


def digest(parts: list[tuple[str, memoryview]], visit: Callable[[int, int, memoryview], None] | None = None) -> str:
    """The digest of a tensor given as its parts' (description, bytes): the weights, and
    for native FP8 their block scales. Hashed CHUNK_BYTES at a time; each chunk, just
    hashed and still in the cache, goes to `visit(part, first byte, chunk)`: what else
    must read every byte (the loader's finiteness check and write) then costs no second
    pass over memory. Chunking does not change the digest. One thread hashes: the loaders
    run one per core, each on its own tensors; BLAKE3's own threads beside them (a tensor of
    4 MiB or more was hashed by all cores) made the H200 load V2-Lite in 4.05 s against 3.06
    s (results/cold/cold-v2lite-hash-*-h200.json); likely each chunk was then checked and copied
    from other cores' caches."""
    h = blake3(max_threads=1)
    for index, (description, data) in enumerate(parts):
        h.update(description.encode())
        for at in range(0, len(data), CHUNK_BYTES):
            chunk = data[at : at + CHUNK_BYTES]
            h.update(chunk)  # (releases the GIL)
            if visit is not None:
                visit(index, at, chunk)
    return h.hexdigest()


def describe(dtype: str, shape: tuple[int, ...]) -> str:
    """What a tensor's digest says of it besides its bytes (torch's printed dtype and shape)."""
    return f"torch.{dtype}{tuple(shape)}"


def tensor_digest(tensor: torch.Tensor, scale_inv: torch.Tensor | None = None,
                  visit: Callable[[int, int, memoryview], None] | None = None) -> str:
    """`digest` of torch tensors (the same as of their bytes read straight from the file)."""
    import torch

    parts = [t.contiguous() for t in (tensor, scale_inv) if t is not None]
    return digest([(describe(str(t.dtype).removeprefix("torch."), tuple(t.shape)),
                    memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")) for t in parts], visit)


def file_identity(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def aux_digests(model_dir: Path) -> dict[str, str]:
    return {
        name: blake3((model_dir / name).read_bytes()).hexdigest()
        for name in AUX_FILES
        if (model_dir / name).exists()
    }


def fingerprint(aux: dict[str, str], tensors: dict[str, str], settings: dict) -> str:
    """One digest over the config and tokenizer files, every tensor digest, and the
    settings (quant mode, dtype) that shaped the stored weights."""
    record = json.dumps({"format": FORMAT, "aux": aux, "tensors": tensors, "settings": settings}, sort_keys=True)
    return blake3(record.encode()).hexdigest()


@dataclass(frozen=True)
class FileRecord:
    identity: tuple[int, ...]  # (st_dev, st_ino, st_size, st_mtime_ns) when it was read
    tensors: dict[str, str]  # name -> digest of the tensors read from this file


@dataclass(frozen=True)
class Record:
    """The identity record kept in the manifest: digests of the config and tokenizer
    files, and per checkpoint file (by path relative to the checkpoint) its record."""

    aux: dict[str, str]
    files: dict[str, FileRecord]

    def to_wire(self) -> dict:
        return {"format": FORMAT, "aux": self.aux, "files": {rel: {"identity": list(f.identity), "tensors": f.tensors}
                                           for rel, f in self.files.items()}}

    @classmethod
    def from_wire(cls, d: dict) -> Record:
        if d.get("format") != FORMAT:
            raise ValueError(f"an identity record of format {d.get('format', 1)}; this preload reads format {FORMAT}"
                             " (BLAKE3): the daemon and its clients must be of one version")
        files = {rel: FileRecord(tuple(int(x) for x in f["identity"]), dict(f["tensors"])) for rel, f in d["files"].items()}
        return cls(dict(d["aux"]), files)


def checkpoint_record(model_dir: Path, digests: dict[str, str], sources: dict[str, Path]) -> Record:
    """The record of a checkpoint as loaded: `digests` and `sources` give each tensor's
    digest and the file it came from."""
    files: dict[str, FileRecord] = {}
    for name, path in sources.items():
        rel = str(path.relative_to(model_dir))
        entry = files.setdefault(rel, FileRecord(tuple(file_identity(path)), {}))
        entry.tensors[name] = digests[name]
    return Record(aux_digests(model_dir), files)


def changed_on_disk(model_dir: Path, record: Record) -> tuple[list[str], list[str]]:
    """What of `model_dir` is not as `record` found it, cheaply: the small files (config,
    tokenizer: hashed) that differ, and the weight files missing or whose size, time or
    inode changed (their tensors not read: they may still hold the same bytes)."""
    aux = aux_digests(model_dir)
    differ = [name for name in sorted(set(aux) | set(record.aux)) if aux.get(name) != record.aux.get(name)]
    touched = [rel for rel, entry in record.files.items()
               if not (model_dir / rel).exists() or tuple(file_identity(model_dir / rel)) != entry.identity]
    return differ, touched


def verify_checkpoint(model_dir: str | Path, record: Record) -> None:
    """Raise IdentityError, naming what differs, unless `model_dir` holds exactly the
    checkpoint described by `record`."""
    model_dir = Path(model_dir).resolve()
    aux, touched = changed_on_disk(model_dir, record)
    if aux:
        raise IdentityError(f"{model_dir / aux[0]} differs from the daemon's copy")
    for rel in touched:
        if not (model_dir / rel).exists():
            raise IdentityError(f"{model_dir / rel}: missing; the daemon loaded a checkpoint with this file")
    stale = {name: d for rel in touched for name, d in record.files[rel].tensors.items()}
    if not stale:
        return
    from preload.checkpoint.reader import CheckpointError, iter_checkpoint

    cfg = ModelConfig.from_dir(model_dir)
    try:
        for src in iter_checkpoint(model_dir, cfg):
            if src.name in stale and tensor_digest(src.tensor, src.scale_inv) != stale[src.name]:
                raise IdentityError(f"{src.path}: tensor {src.name} differs from the daemon's copy")
    except CheckpointError as e:
        raise IdentityError(f"{model_dir} is not the daemon's checkpoint: {e}") from None
