"""The channel between a supervised worker's two processes: its front (HTTP, the OpenAI
protocol, every request's state and text) and its engine core (the model, the scheduler,
the KV cache). A core can die without any client connection closing: the front holds
them, and hands its unfinished requests to the slot's next core (front.py).

ZeroMQ over a Unix socket in the state dir, bound by the front (ROUTER, 0600, in the 0700
state dir), one per slot, `core_address`; each core of the slot connects a DEALER named by
its pid. Every message is a msgpack map (never pickle), and the front reads a message only
from a peer of its own uid (the kernel's word, ZeroMQ's Peer-Address). Messages:

  core -> front
    {"t": "hello", "pid", "fingerprint", "model", "vocab", "max_model_len", "files",
     "takeover"}                                   it serves the slot: its limits, the tokenizer's
                                                   files; takeover: "first", "died" (the slot's last
                                                   core died: its requests failed over), "restart"
    {"t": "beat", "pid", "stats"}                  every BEAT seconds (EngineStats, as a list); sooner
                                                   once aborts freed sequences or the work ran out
    {"t": "out", "o": [output, ...]}               one engine step's Outputs (`output_to_wire`)
  front -> core
    {"t": "welcome", "front": pid, "hello": bool}  the first answer to a core (hello: send one)
    {"t": "add", "id", "prompt", "output", "params"}   compute a request, from its output so far
    {"t": "abort", "ids": [id, ...]}               the requests that ended in one turn of the front's
                                                   event loop (also taken: {"t": "abort", "id"})
    {"t": "retire"}                                another core has the requests: abort all, exit
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import msgpack
import zmq

from preload.ipc.protocol import slot_socket_path
from preload.worker.engine.engine import EngineStats
from preload.worker.engine.output import Output
from preload.worker.engine.sampling_params import SamplingParams

BEAT = 0.25  # seconds between a core's beats
MAX_MESSAGE = 256 << 20  # (a hello carries the tokenizer's files: megabytes)


def core_address(state_dir: Path, slot: int) -> str:
    return f"ipc://{slot_socket_path(state_dir, slot)}"


def encode(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode(data: bytes) -> dict:
    msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ValueError("not a channel message")
    return msg


def peer_uid(frame: zmq.Frame) -> int:
    """The uid of the process that sent `frame` (libzmq appends ':uid:gid:pid' to an ipc
    peer's address)."""
    return int(frame.get("Peer-Address").rsplit(":", 3)[1])


def own(frame: zmq.Frame) -> bool:
    return peer_uid(frame) == os.getuid()


# ---- what crosses it ------------------------------------------------------------------------

_TUPLES = {"stop": tuple, "stop_token_ids": tuple, "logit_bias": lambda pairs: tuple(tuple(p) for p in pairs)}


def params_to_wire(p: SamplingParams) -> dict:
    return dataclasses.asdict(p)


def params_from_wire(d: dict) -> SamplingParams:
    """SamplingParams as sent (their checks run again: the core trusts no message)."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"unknown sampling fields {sorted(unknown)}")
    return SamplingParams(**{k: _TUPLES[k](v) if k in _TUPLES else v for k, v in d.items()})


def output_to_wire(o: Output) -> list:
    prompt_tops = None if o.prompt_top_logprobs is None else [_pairs(t) for t in o.prompt_top_logprobs]
    return [o.seq_id, o.token_ids, o.logprobs, [_pairs(t) for t in o.top_logprobs], o.prompt_logprobs, o.finish_reason,
            o.error, o.prompt_ranks, prompt_tops, o.cached_tokens, o.refused]


def output_from_wire(w: list) -> Output:
    seq_id, tokens, logprobs, tops, prompt_logprobs, finish, error, prompt_ranks, prompt_tops, cached, refused = w
    return Output(seq_id, list(tokens), list(logprobs), [_dict(t) for t in tops], "", finish, prompt_logprobs, error,
                  prompt_ranks, None if prompt_tops is None else [_dict(t) for t in prompt_tops], cached, bool(refused))


def _pairs(top: dict[int, float] | None) -> list | None:
    return None if top is None else list(top.items())  # (msgpack keeps no int keys)


def _dict(pairs: list | None) -> dict[int, float] | None:
    return None if pairs is None else {int(i): lp for i, lp in pairs}


def stats_to_wire(s: EngineStats) -> list:
    return list(dataclasses.astuple(s))


def stats_from_wire(w: list) -> EngineStats:
    """An engine's figures from a core's beat. Fields are only ever added at the end, with
    defaults: an older core's beat reads (the rest at their defaults), and so does a newer
    core's (what this front does not know of left out), since a front outlives a rolling
    restart onto new code."""
    return EngineStats(*w[: len(dataclasses.fields(EngineStats))])
