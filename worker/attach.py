"""`attach(state_dir)`: the daemon's weights as a read-only name -> tensor mapping, zero-copy."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from preload.checkpoint.identity import IdentityError
from preload.ipc.arena import map_arena
from preload.ipc.client import DaemonClient, DaemonUnavailable
from preload.ipc.manifest import FILE_PREFIX, ArenaInfo, Manifest
from preload.ipc.protocol import default_state_dir
from preload.ipc.views import tensor_views


class AttachedWeights(Mapping[str, torch.Tensor]):
    """Read-only views of the daemon's arena. `manifest` says what was loaded and how;
    `fingerprint` identifies the exact bytes; `files` holds config and tokenizer files."""

    def __init__(self, state_dir: Path, manifest: Manifest, arena, client: DaemonClient):
        self.state_dir, self.manifest, self._arena, self._client = state_dir, manifest, arena, client
        # tensor_views refuses entries outside the arena, overlapping or misshapen
        self._tensors = tensor_views(arena.base, manifest.layout)
        files = [name for name in self._tensors if name.startswith(FILE_PREFIX)]
        self.files = {name.removeprefix(FILE_PREFIX): bytes(self._tensors.pop(name).cpu().numpy()) for name in files}

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def config(self) -> dict:
        return json.loads(self.files["config.json"])

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def let_go_of_memory(self) -> None:
        """The arena unmapped and let go, its addresses kept (a cuda-vmm mapping's
        let_go_keeping_address): the views stay, unreadable until map_again."""
        self._arena.let_go_keeping_address()

    def map_again(self, info: ArenaInfo, fds: list[int], fingerprint: str) -> None:
        """The daemon's new arena of the same bytes (its `fingerprint` says so) where the
        last one was: every view reads it."""
        if fingerprint != self.fingerprint:
            raise IdentityError(f"the daemon offers weights {fingerprint[:12]}, not these ({self.fingerprint[:12]})")
        self._arena.map_again(info, fds)

    def close(self) -> None:
        """Tell the daemon we are done; views already handed out stay valid until freed."""
        if self._client is not None:
            try:
                self._client.request("release", timeout=1.0)
            except DaemonUnavailable:
                pass  # the daemon is gone: nobody to tell, and the mapping is ours to drop
            finally:
                self._client.close()
                self._client = None
                self._arena.close()

    def __enter__(self) -> AttachedWeights:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def attach(state_dir: str | Path | None = None, timeout: float = 10.0, dp_rank: int = 0) -> AttachedWeights:
    """The daemon's weights, mapped read-only: its copy for data-parallel rank `dp_rank`."""
    state_dir = Path(state_dir) if state_dir else default_state_dir()
    client = DaemonClient(state_dir, timeout)
    ranked = {"dp_rank": dp_rank} if dp_rank else {}
    try:
        client.request("hello", **ranked)
        manifest = Manifest.from_wire(client.request("manifest", **ranked)["manifest"])
        arena = map_arena(*client.arena_fds(dp_rank))
    except BaseException:
        client.close()
        raise
    try:
        return AttachedWeights(state_dir, manifest, arena, client)
    except BaseException:
        client.close()
        arena.close()  # a refused manifest must not leave the arena's fd open
        raise
