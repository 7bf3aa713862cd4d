"""A worker's processes: attach to the daemon, serve HTTP until told to stop.

/health is 503 until the worker can answer a request correctly; on SIGTERM it turns 503
again while in-flight requests drain (up to a timeout), then the process exits.

On its own (`preload serve`), a worker is one process: HTTP and the engine on its own
thread (`serve`). Supervised by the daemon, a slot is two processes, both forked by the
daemon's zygote: its front (`serve_front`: the daemon's listening socket, HTTP, the
requests' state; no CUDA) and its engine core (`serve_core`: the model, the scheduler,
the KV cache), talking over the slot's channel (core_channel.py). A core warms up, says
so, waits for its slot, then allocates its KV cache and serves its front; when it dies,
the front hands its requests to the slot's next core, and no client notices more than a
pause (front.py). Each talks to the daemon over its own link (worker/link.py); a front
also hears there that the slot sleeps (`preload sleep`: its cores killed) or wakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from preload.checkpoint.tokenizer import Tokenizer
from preload.kernels import ahead
from preload.ipc.client import DaemonUnavailable
from preload.ipc.kv_memory import KvMemory
from preload.ipc.manifest import ArenaInfo
from preload.ipc.protocol import default_state_dir, log_output_to
from preload.ipc.sockets import listen
from preload.options import CPU_KV_CACHE_BYTES, ServeOptions
from preload.worker.api.state import WorkerState
from preload.worker.core import Core, hello_of
from preload.worker import tensor_group
from preload.worker.core_channel import core_address
from preload.worker.engine.async_engine import AsyncEngine
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence
from preload.worker.front import CoreClient
from preload.worker.link import DaemonLink, KvOffer
from preload.worker.llm import LLM
from preload.worker.load_board import PUBLISH, GatedSocket, LoadBoard
from preload.worker.model.kv_cache import bytes_per_token, kv_cache_share

log = logging.getLogger("preload.worker")
HTTP_MODULES = ("fastapi", "uvicorn", "preload.worker.api.app", "preload.worker.http_server")  # a front's alone

WARM_UP_KV_BYTES = 16 << 20  # a few blocks of any model: the warm-up prompt needs one
# Two tokens: a prompt's step, which runs eagerly and loads the kernels a first request's
# prompt needs. (One token would be a decode step, replayed in a graph: on a lazy start it
# captures the batch-1 graph instead, which the idle engine does anyway once ready. H200,
# V2-Lite: a first request of 32 tokens took 0.16 s after this warm-up, 0.22 s after the
# one-token one, and the worker was ready as soon: results/cold/cold-v2lite-w1-early-zygote-*.)
WARM_UP_PROMPT = [0, 0]


def kv_cache_bytes(opts: ServeOptions, llm: LLM) -> int:
    """The KV cache budget: as configured, or on a GPU (auto) this worker's share of
    what the daemon's weights leave free; 512 MiB on CPU."""
    e, cfg = opts.worker.engine, llm.config
    if e.kv_cache_memory is not None:
        return e.kv_cache_memory
    if llm.device.type != "cuda":
        return CPU_KV_CACHE_BYTES
    # (Loaded in this process, without a daemon: the weights are what this process holds.)
    weights = llm.attached.manifest.arena.size if llm.attached else torch.cuda.memory_allocated(llm.device)
    share = kv_cache_share(cfg, llm.device, weights, e.max_num_batched_tokens, opts.workers, opts.spares,
                           e.gpu_memory_utilization)
    # More than every sequence at full length is never used (and a small model would get millions of blocks).
    context = min(cfg.max_position_embeddings, e.max_model_len or cfg.max_position_embeddings)
    useful = e.max_num_seqs * context * bytes_per_token(cfg, cfg.num_layers, llm.dtype, e.kv_cache_dtype)
    return min(share, useful)


def slot_memory(offer: KvOffer | None, device: torch.device) -> Callable[[int], KvMemory]:
    """Where a supervised worker's KV cache lives: the memory its slot's last worker left
    (`offer`, from the daemon), if it is large enough, else new memory (its fd then goes
    to the daemon, for the next worker). See ipc/kv_memory.py."""

    def memory(need: int) -> KvMemory:
        if offer is not None:
            if offer.kv_memory_bytes >= need:
                return KvMemory.attach(offer.fd, offer.kv_memory_bytes, device)
            log.warning("the slot's KV memory (%d bytes) is smaller than this worker's cache (%d): making new memory",
                        offer.kv_memory_bytes, need)
            os.close(offer.fd)
        return KvMemory.create(need, device)

    return memory


def serve(opts: ServeOptions, sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM, the engine in this process: /health 503 until it has answered
    a warm-up request."""
    from preload.worker.api.app import create_app  # (the HTTP stack: see serve_front)
    from preload.worker.http_server import DrainingServer, http_config

    w = opts.worker
    state = WorkerState()
    llm = open_weights(opts, state, supervised=False, lazy_graphs=False)
    log.info("weights attached in %.3f s", time.monotonic() - state.started)
    name = Path(llm.attached.manifest.model if llm.attached else opts.model).name  # (unless --served-model-name)
    engine = AsyncEngine(llm.engine, on_fatal=lambda: setattr(server, "should_exit", True))

    async def warm_up() -> None:
        async for _ in engine.submit(Sequence(WARM_UP_PROMPT, SamplingParams(max_tokens=1))):
            pass
        mark_ready(state)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start(asyncio.get_running_loop())
        warming = asyncio.ensure_future(warm_up())  # /health says 503 meanwhile
        yield
        warming.cancel()

    app = create_app(engine, llm.tokenizer, name, state, w, lifespan)
    server = DrainingServer(http_config(app, w), state, engine, w.drain_timeout, shared_socket=False)
    llm.start_engine(replace(w.engine, kv_cache_memory=kv_cache_bytes(opts, llm)))
    engine.use(llm.engine)
    log.info("KV cache: %d tokens", llm.engine.max_model_len)
    freeze_objects()
    try:
        server.run(sockets=[sock or listen(opts.host, opts.port)])
    finally:
        engine.stop()
        llm.close()
    if engine.error is not None:  # exit non-zero: a supervisor or systemd starts a fresh worker
        raise RuntimeError(f"engine failed: {engine.error}") from engine.error


def serve_core(opts: ServeOptions, sock: socket.socket, link: DaemonLink, lazy_graphs: bool) -> None:
    """A slot's engine core. It attaches and warms up (its kernels loaded) while the slot
    waits, says so, waits for its slot; then it allocates its KV cache (the slot's, if its
    last core left one) and serves the slot's front until retired, drained or failed.
    `lazy_graphs`: a core a slot waits for captures its graphs after it is ready
    (cuda_graphs.py, prompt_graphs.py); a spare, whose start no one waits for, captures
    them all first."""
    w = opts.worker
    state = WorkerState()
    core: Core | None = None
    link.beat(lambda: core.progress() if core else (0, False))  # from now on: one stuck before its engine runs too
    e = w.engine
    leader = None if e.tensor_parallel_size == 1 else tensor_group.start(
        e.tensor_parallel_size, e.enable_expert_parallel, Path(opts.state_dir) / f"group-{os.getpid()}.rendezvous",
        {"state_dir": str(opts.state_dir), "dp_rank": opts.dp_rank})  # (its followers attach while this core does)
    llm = open_weights(opts, state, supervised=True, lazy_graphs=lazy_graphs, leader=leader)
    log.info("weights attached in %.3f s", time.monotonic() - state.started)
    freeze_objects()
    t = time.monotonic()
    llm.generate([WARM_UP_PROMPT], max_tokens=1)  # loads the kernels: the slow part of a worker's start on a GPU
    log.info("first step (its kernels loaded, compiled if new) in %.3f s", time.monotonic() - t)
    if not lazy_graphs:
        capture_prompt_graphs(llm)
    link.report("warm")
    slot = link.wait_for_slot(llm.let_go_of_weights, lambda msg, fds: map_weights_again(llm, msg, fds))
    if slot is None:
        log.info("the daemon went away before giving this worker a slot")
        if llm.weights_let_go:  # (kept through a sleep: closing would unmap weights not mapped; nothing to drain)
            logging.shutdown()
            os._exit(0)
        llm.close()
        return
    t = time.monotonic()
    offer = link.kv_offer
    budget = offer.kv_cache_bytes if offer else kv_cache_bytes(opts, llm)
    llm.start_engine(replace(w.engine, kv_cache_memory=budget), kv_memory=slot_memory(offer, llm.device))
    memory = llm.engine.kv_memory
    log.info("KV cache: %.2f GiB, %d tokens, %s in %.3f s", budget / (1 << 30), llm.engine.max_model_len,
             "the slot's, mapped again" if offer is not None and not memory.fresh else "made", time.monotonic() - t)
    link.kv_fd = memory.fd
    link.claim = {"fingerprint": llm.attached.manifest.fingerprint, "kv_cache_bytes": budget,
                  "kv_memory_bytes": memory.size, "listen": list(sock.getsockname()[:2]), "dp_rank": opts.dp_rank}
    name = Path(llm.attached.manifest.model).name  # the checkpoint's; a front serves --served-model-name if given
    core = Core(llm, core_address(opts.state_dir, slot), hello_of(llm, name, link.takeover), w.drain_timeout)
    link.report("ready", fds=(link.kv_fd,), **link.claim)
    mark_ready(state)
    try:
        core.run()
    finally:
        core.close()
        llm.close()


def map_weights_again(llm: LLM, msg: dict, fds: list[int]) -> None:
    """A spare kept through a sleep, at the wake: the daemon's new arena (its fd in `fds`)
    where the last one was (worker/link.py's "remap")."""
    try:
        llm.map_weights_again(ArenaInfo.from_wire(msg["arena"]), fds, str(msg["fingerprint"]))
    except BaseException:
        for fd in fds:  # (not taken)
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def capture_prompt_graphs(llm: LLM) -> None:
    """A spare captures its prompt steps' graphs before it is warm, against its warm-up
    cache (their cache writes go through the decode graphs' address table, which the
    slot's cache fills at takeover), as it does its decode graphs. Else the first steps
    after a takeover, which compute the handed-over requests again, captured their buckets
    then: on an H100 with V2-Lite a stream's pause across a kill was 0.53 s p50 at 8 clients
    where the spare took the slot in 0.17 s (results/failover/failover-v2lite-h100.json).
    Its memory is the reserve each spare keeps as a worker does (kv_cache_share)."""
    t, pending = time.monotonic(), llm.engine.graphs_pending()
    while llm.engine.capture_idle():
        pass
    if pending:
        log.info("%d graph buckets captured in %.3f s", pending, time.monotonic() - t)


def serve_front(opts: ServeOptions, slot: int, sock: socket.socket, link: DaemonLink,
                tokenizer_dir: str | None = None) -> None:
    """A slot's front: the daemon's listening socket, HTTP and every request's state, its
    engine in the slot's core process (front.py). It binds the slot's channel, waits for a
    core's hello (its tokenizer and limits), and then accepts; no CUDA here. The tokenizer
    is read from `tokenizer_dir` (the daemon's checkpoint) while the core starts."""
    w = opts.worker
    state = WorkerState(weights_note=f"the daemon's on {opts.state_dir}, through slot {slot}'s engine core")
    client = CoreClient(core_address(opts.state_dir, slot))  # bound first: a core's hello waits there, not in retries
    link.beat(client.progress)
    # The HTTP stack, imported here: a core never needs it, and a zygote imports it once it is
    # ready (preloadd/zygote_process.py), so that a start's first front, forked at once, imports it
    # beside its core's start, not before the fork.
    from preload.worker.api.app import create_app
    from preload.worker.http_server import DrainingServer, http_config

    client.read_ahead = read_tokenizer(tokenizer_dir)  # (the hello is read once the loop below runs)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # `preload sleep` and `wake` come on the link's thread; the client lives on this loop.
        link.on_sleep = lambda sleeping, level: loop.call_soon_threadsafe(client.sleep, sleeping, level)
        link.listen()
        reading, publishing = asyncio.ensure_future(client.run()), None
        try:
            await client.hello.wait()
            link.claim = {"role": "front", "fingerprint": client.info["fingerprint"], "dp_rank": opts.dp_rank,
                          "listen": list(sock.getsockname()[:2])}  # (what a new daemon is told of us)
            app = create_app(client, client.tokenizer, client.info["model"], state, w)
            app.state.serving.metrics.worker = str(slot)
            app.state.serving.metrics.dp_rank = str(opts.dp_rank)  # (the GPU whose copy its cores map)
            server = DrainingServer(http_config(app, w), state, client, w.drain_timeout, shared_socket=True)
            board = LoadBoard(opts.state_dir, slot)
            gated = GatedSocket(sock, board, lambda: len(server.server_state.connections))
            server.on_drain = board.close  # (a draining front takes no connection: peers stop counting it)
            publishing = asyncio.ensure_future(publish_load(gated, state))
            freeze_objects()
            mark_ready(state)
            link.report("ready")
            await server.serve(sockets=[gated])
        finally:
            reading.cancel()
            if publishing is not None:
                publishing.cancel()

    try:
        asyncio.run(main())
    finally:
        client.close()


def read_tokenizer(model_dir: str | None) -> Tokenizer | None:
    """The checkpoint's tokenizer, parsed while the slot's core starts: parsed after its hello
    it was on the way to a start's ready (0.08 s for a word list of 102,400 on the CPU machine,
    more for a real vocabulary's merges). None where its files cannot be read or parsed: the
    hello's then serve, as they would anyway where they differ (checkpoint/tokenizer.py made_of)."""
    if model_dir is None:
        return None
    try:
        return Tokenizer.from_dir(model_dir)
    except Exception:  # noqa: BLE001 (a read ahead only: the hello's files are the tokenizer)
        return None


async def publish_load(gated: GatedSocket, state: WorkerState) -> None:
    """This front's load on the board every PUBLISH seconds, until it drains."""
    while state.phase != "draining":
        gated.publish()
        await asyncio.sleep(PUBLISH)


def http_import_steps() -> list[Callable[[], object]]:
    """The HTTP stack a front imports (FastAPI, uvicorn, the API's routes: 0.5 s on the CPU
    machine, of a zygote's 2.7), as steps a zygote takes once it is ready (preloadd/zygote_process.py)."""
    return [partial(importlib.import_module, name) for name in HTTP_MODULES]


def freeze_objects() -> None:
    """The model's (or the app's) objects live as long as the process: the collector need
    not walk them again (a full collection of them, landing inside a decode step, stalls
    it). Before a slot: a spare's take-over then does none of this."""
    gc.collect()
    gc.freeze()


def open_weights(opts: ServeOptions, state: WorkerState, supervised: bool, lazy_graphs: bool,
                 leader: tensor_group.Leader | None = None) -> LLM:
    """The model on the daemon's weights; or, when no daemon answers on the state dir and
    --model names a checkpoint (and neither --require-daemon nor a supervisor says the
    daemon is a must), on the checkpoint loaded here, as vLLM's preload falls back: the
    worker still serves, said loudly in its log and /status."""
    engine = replace(opts.worker.engine, kv_cache_memory=WARM_UP_KV_BYTES)
    try:
        llm = LLM(opts.model, state_dir=opts.state_dir or default_state_dir(), engine=engine, lazy_graphs=lazy_graphs,
                  leader=leader, dp_rank=opts.dp_rank)
        state.weights_note = f"the daemon's on {llm.attached.state_dir}"
        return llm
    except DaemonUnavailable as e:
        if supervised or opts.require_daemon or opts.model is None:
            raise
        note = (f"no daemon: {e}; {opts.model} loaded in this process, a copy of the weights of this worker's own,"
                " read again at every restart (--require-daemon refuses to start instead)")
    log.warning("*** %s ***", note)
    state.weights, state.weights_note = "in-process", note
    return LLM(opts.model, engine=engine, lazy_graphs=lazy_graphs)


def mark_ready(state: WorkerState) -> None:
    state.phase = "ready"
    log.info("ready in %.3f s", time.monotonic() - state.started)
    if kernels := ahead.recorded():  # (a first start's, or a start on kernels compiled ahead: which it met)
        log.info("%s", kernels)


def serve_supervised(opts: ServeOptions, forked_for: int | None, sock: socket.socket, link_fd: int,
                     role: str = "core", tokenizer_dir: str | None = None) -> int:
    """Run a worker for the daemon: its options, the slot it was forked for (None: a
    spare core), the daemon's listening socket, its link to the daemon, its role in the
    slot (a "core" or a "front") and (a front's) the checkpoint to read the tokenizer from."""
    if role == "front":
        log_format(f"front-{forked_for}")
        title(f"front {forked_for}", opts)
        link = DaemonLink(link_fd, state_dir=opts.state_dir, on_retire=lambda why: os.kill(os.getpid(), signal.SIGTERM))
        link.slot = forked_for
        try:
            serve_front(opts, forked_for, sock, link, tokenizer_dir)
        finally:
            link.close()
        return 0
    log_format(f"spare-{os.getpid()}" if forked_for is None else f"worker-{forked_for}")
    title("spare" if forked_for is None else f"worker {forked_for}", opts)

    def on_slot(slot: int) -> None:
        if slot == forked_for:
            return
        title(f"worker {slot}", opts)
        # A spare promoted: from here on this is worker `slot`, and its log is that slot's log.
        log_output_to(Path(opts.state_dir) / f"worker-{slot}.log")
        log_format(f"worker-{slot}")
        log.info("serving slot %d (pid %d)", slot, os.getpid())

    # Taken over by a new daemon, or retired by it (then drain, as on SIGTERM).
    link = DaemonLink(link_fd, on_slot, opts.state_dir, on_retire=lambda why: os.kill(os.getpid(), signal.SIGTERM))
    try:
        serve_core(opts, sock, link, lazy_graphs=forked_for is not None)
    finally:
        link.close()
    return 0


def title(role: str, opts: ServeOptions) -> None:
    """What `ps` shows for this process: `preload worker 1 --state-dir ...`, `preload spare ...`."""
    from setproctitle import setproctitle

    setproctitle(f"preload {role} --state-dir {opts.state_dir}")


def log_format(name: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s", force=True)
