"""A tensor-parallel group of engine processes (`--tensor-parallel-size N`, issue 38): rank
0, the slot's engine core, schedules and samples; ranks 1 .. N-1 (its followers) compute
their share of each step's forward (worker/model/parallel.py), the partial sums added by
the all-reduces inside the model.

Rank 0's model is wrapped (`Leader`, around each engine it builds): before each forward it
sends the step to the group, the tokens and the attention metadata as msgpack in a byte
tensor (torch.distributed's object collectives pickle: not here), and each follower
(`follow`) builds the same tensors and runs the same forward into its own latent cache, at
the same slots, which rank 0's block manager chooses for all. A new engine's cache layout
is sent the same way ("cache"); "stop" ends the followers.

The group lives and dies as one, the core being the one the daemon supervises: the core
spawns its followers (`start`) and reaps them; a follower that dies breaks the next
collective, which fails the core's engine, and the core's death kills its followers
(PR_SET_PDEATHSIG), so that the supervisor's replacement starts a whole new group.
Eager steps only (no CUDA graphs, no drafts): the group is the CPU's for now.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import fields
from pathlib import Path

import msgpack
import psutil
import torch
import torch.distributed as dist

from preload.checkpoint.config import ModelConfig
from preload.worker.model.deepseek import Transformer
from preload.worker.model.kv_cache import AttentionMeta, LatentCache
from preload.worker.model.parallel import Ranks, rank_config, shard

PR_SET_PDEATHSIG = 1
WATCH = 0.2  # seconds between the core's looks at its followers

log = logging.getLogger("preload.worker")


class Leader:
    """Rank 0's side: `ranks`, and the model proxy that sends each step to the followers."""

    def __init__(self, ranks: Ranks, followers: list[subprocess.Popen], rendezvous: Path):
        self.ranks, self.followers, self.rendezvous = ranks, followers, rendezvous
        self._closing = threading.Event()
        threading.Thread(target=self._watch, name="followers", daemon=True).start()

    def _watch(self) -> None:
        """A follower that dies ends the core at once (not at the group's next step, which
        could be long in coming): the supervisor replaces the core, and so the group."""
        while not self._closing.wait(WATCH):
            for p in self.followers:
                if p.poll() is not None:
                    log.error("rank %d of the group (pid %d) ended (%s): the core ends with it",
                              self.followers.index(p) + 1, p.pid, p.returncode)
                    os._exit(1)

    def lead(self, engine) -> None:
        """A new engine: its cache's layout to the followers, its model wrapped."""
        c = engine.cache
        send({"t": "cache", "layers": len(c.c_kv), "slots": c.c_kv[0].shape[0], "kv_cache_dtype": "fp8" if c.fp8 else "auto"})
        engine.model = Stepping(engine.model)

    def close(self) -> None:
        self._closing.set()
        try:
            send({"t": "stop"})
        except RuntimeError:
            pass  # a follower gone: the others see the group break and exit too
        for p in self.followers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        dist.destroy_process_group()
        self.rendezvous.unlink(missing_ok=True)


class Stepping:
    """A model whose every forward is sent to the followers first."""

    def __init__(self, model: Transformer):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens: torch.Tensor, meta: AttentionMeta, cache: LatentCache) -> torch.Tensor:
        send({"t": "step", "tokens": tokens.tolist(), "meta": meta_to_wire(meta)})
        return self.model.forward(tokens, meta, cache)


def start(ranks_size: int, expert_parallel: bool, rendezvous: Path, spec: dict) -> Leader:
    """Rank 0 of a new group: its followers spawned (fresh interpreters: each attaches to
    the daemon's weights itself, `spec`), the group formed over gloo at `rendezvous`, a file
    of ours (`group-<pid>.rendezvous` in the state dir, 0700: not a port others could reach),
    made anew; those of dead cores go."""
    for old in rendezvous.parent.glob("group-*.rendezvous"):  # (a killed core's, which could not remove its own)
        pid = old.name.split("-")[1].split(".")[0]
        if not (pid.isdigit() and psutil.pid_exists(int(pid))):
            old.unlink(missing_ok=True)
    rendezvous.unlink(missing_ok=True)
    init = f"file://{rendezvous}"
    followers = [subprocess.Popen([sys.executable, "-m", "preload.worker.tensor_group", json.dumps(
        spec | {"rank": r, "size": ranks_size, "expert_parallel": expert_parallel, "init": init, "parent": os.getpid()})])
        for r in range(1, ranks_size)]
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=ranks_size)
    return Leader(Ranks(0, ranks_size, expert_parallel), followers, rendezvous)


def follow(model: Transformer, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """A follower's loop: build each cache rank 0 builds, run each step rank 0 runs."""
    cache = None
    while (msg := receive())["t"] != "stop":
        if msg["t"] == "cache":
            cache = None  # (the old one first: two would not fit where memory is short)
            cache = LatentCache(msg["layers"], msg["slots"], cfg, dtype, device, msg["kv_cache_dtype"])
        else:
            tokens = torch.tensor(msg["tokens"], dtype=torch.long, device=device)
            with torch.inference_mode():
                model.forward(tokens, meta_from_wire(msg["meta"], device), cache)


# ---- the wire: msgpack in a byte tensor, its length first --------------------------------------


def send(msg: dict) -> None:
    data = torch.frombuffer(bytearray(msgpack.packb(msg, use_bin_type=True)), dtype=torch.uint8)
    dist.broadcast(torch.tensor([len(data)], dtype=torch.long), src=0)
    dist.broadcast(data, src=0)


def receive() -> dict:
    length = torch.zeros(1, dtype=torch.long)
    dist.broadcast(length, src=0)
    data = torch.empty(int(length), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    return msgpack.unpackb(data.numpy().tobytes(), raw=False)


def meta_to_wire(meta: AttentionMeta) -> dict:
    out = {}
    for f in fields(meta):
        v = getattr(meta, f.name)
        out[f.name] = {"tensor": v.tolist(), "dtype": str(v.dtype).removeprefix("torch.")} if torch.is_tensor(v) else v
    return out


def meta_from_wire(d: dict, device: torch.device) -> AttentionMeta:
    return AttentionMeta(**{k: torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"]), device=device)
                            if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v for k, v in d.items()})


# ---- a follower process ------------------------------------------------------------------------


def main(spec: dict) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the core's death is ours
    if os.getppid() != spec["parent"]:
        return  # it died before we could say so
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec["size"]))
    dist.init_process_group("gloo", init_method=spec["init"], rank=spec["rank"], world_size=spec["size"])
    from preload.worker.attach import attach

    weights = attach(spec["state_dir"], dp_rank=spec.get("dp_rank", 0))  # (its core's copy of the weights)
    m = weights.manifest
    cfg = ModelConfig.from_dir(m.model)
    ranks = Ranks(spec["rank"], spec["size"], spec["expert_parallel"])
    mine = rank_config(cfg, ranks)
    model = Transformer(mine, shard(cfg, weights, ranks), ranks)
    try:
        follow(model, mine, getattr(torch, m.dtype), torch.device(m.device))
    finally:
        weights.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
