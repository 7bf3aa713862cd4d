"""The manifest: the contract between the daemon and every process that attaches.

It says what the daemon holds (the checkpoint directory, its config, the quantization
and dtype that shaped the stored weights, the device), how to map it (the arena's
transport and size), where each tensor lies in it (the layout), and exactly which
bytes those are (the identity record and the fingerprint). It travels as a msgpack map;
`from_wire` checks every field's type before a worker trusts it, and `tensor_views`
(ipc/layout.py) checks what the layout says.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from preload.checkpoint.identity import Record
from preload.ipc.layout import Layout
from preload.ipc.protocol import ProtocolError

# Arena entries named FILE_PREFIX + file name hold the checkpoint's small text files
# (config.json, tokenizer files) as bytes, so that a worker needs nothing from the disk.
FILE_PREFIX = "files/"


@dataclass(frozen=True)
class ArenaInfo:
    """How to map an arena; its fds (if any) travel beside the manifest over SCM_RIGHTS."""

    transport: str  # "memfd", "cuda-vmm" or "cuda-ipc"
    size: int  # bytes
    device: int | None = None  # CUDA ordinal (CUDA transports)
    ipc_handle: bytes | None = None  # cuda-ipc: the 64-byte cudaIpcMemHandle

    def to_wire(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_wire(cls, d: object) -> ArenaInfo:
        _check_map(d, "arena", {"transport": str, "size": int}, {"device": int, "ipc_handle": bytes})
        return cls(**d)


@dataclass(frozen=True)
class Manifest:
    model: str  # the checkpoint directory the daemon loaded
    config: dict  # its config.json, parsed
    quant: str  # "none", "fp8_per_tensor" or "fp8_block"
    dtype: str  # torch dtype name of the unquantized weights
    device: str  # "cpu", "cuda:0", ...
    arena: ArenaInfo
    layout: Layout
    record: Record  # per checkpoint file: its identity on disk and its tensors' digests
    fingerprint: str

    def to_wire(self) -> dict:
        scalars = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("arena", "layout", "record")}
        return scalars | {"arena": self.arena.to_wire(), "layout": self.layout.to_wire(), "record": self.record.to_wire()}

    @classmethod
    def from_wire(cls, d: object) -> Manifest:
        simple = {"model": str, "config": dict, "quant": str, "dtype": str, "device": str, "fingerprint": str}
        _check_map(d, "manifest", simple | {"arena": dict, "layout": dict, "record": dict}, {})
        try:
            record = Record.from_wire(d["record"])
        except (TypeError, ValueError, KeyError) as e:
            raise ProtocolError(f"malformed manifest record: {e}") from None
        return cls(**{k: d[k] for k in simple}, arena=ArenaInfo.from_wire(d["arena"]),
                   layout=Layout.from_wire(d["layout"]), record=record)


def _check_map(d: object, what: str, required: dict[str, type], optional: dict[str, type]) -> None:
    if not isinstance(d, dict):
        raise ProtocolError(f"malformed {what}: not a map")
    unknown = set(d) - set(required) - set(optional)
    missing = set(required) - set(d)
    if unknown or missing:
        raise ProtocolError(f"malformed {what}: missing {sorted(missing)}, unknown {sorted(unknown)}")
    for key, kind in (required | optional).items():
        value = d.get(key)
        if key in d and not (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
            raise ProtocolError(f"malformed {what}: {key} is {type(value).__name__}, expected {kind.__name__}")
