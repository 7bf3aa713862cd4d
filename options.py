"""Every option of the daemon and its workers, defined once: name, type, default, help.

The command line is generated from these dataclasses (cli/options.py), the detached
daemon and the zygote receive them as JSON (`to_json` / `from_json`), and code reads
the defaults from here, never from a literal of its own. This module imports nothing
heavy (no torch), so the CLI, the daemon's first steps and tests can all use it.

A field's metadata holds its help text and, where the command line differs from the
Python value, how to show and parse it (sizes like 512MiB, "auto" for None).
"""

from __future__ import annotations

import functools
import os
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any


@functools.cache
def version() -> str:
    """This install's version (`preload --version`, /version): looked up when asked, since
    importlib.metadata walks every entry of sys.path (60 ms of a daemon's start)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("preload")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


BUNDLED_MODEL = str(Path(__file__).parent / "bundled" / "tiny-v3")
QUANT_MODES = ("none", "fp8_per_tensor", "fp8_block")
DTYPES = ("float32", "bfloat16", "float16")
TRANSPORTS = ("memfd", "cuda-vmm", "cuda-ipc")
KV_CACHE_DTYPES = ("auto", "fp8")
STATE_DIR_HELP = ("Daemon state dir [default: $XDG_RUNTIME_DIR/preload, else /run/preload for root, else this uid's"
                  " private $TMPDIR/preload-$UID-XXXXXX, made by preload start as mkdtemp makes one].")
CPU_KV_CACHE_BYTES = 512 << 20  # what --kv-cache-memory auto means on CPU, and for an in-process LLM

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from '512MiB', '2GiB', '5GB', '1048576'; ValueError otherwise."""
    t = text.strip().lower()
    number = t.rstrip("kmgib")
    if not number or t[len(number):] not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size like 512MiB or 2GiB")
    value = int(float(number) * _SIZE_UNITS[t[len(number):]])
    if value < 0:
        raise ValueError(f"{text!r} is negative")
    return value


def show_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_auto_size(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else parse_size(text)


def option(default: Any = MISSING, help: str = "", *, choices: tuple | None = None, bounds: tuple | None = None,
           parse=None, show=None, cli: bool = True, flag: str | None = None, default_factory: Any = MISSING):
    """A dataclass field with what the command line needs to offer it.

    choices: allowed values; bounds: (min, max) of a number, either may be None;
    parse / show: the command line's text -> value and value -> text, when the value
    is not what is typed (sizes, "auto"); cli=False keeps a field off the command line;
    flag: the option's name when it is not --field-name (booleans: "--x/--no-x")."""
    meta = {"help": help, "choices": choices, "bounds": bounds, "parse": parse, "show": show, "cli": cli, "flag": flag}
    return field(default=default, default_factory=default_factory, metadata=meta)


@dataclass(frozen=True)
class EngineOptions:
    """The engine of one worker: its KV cache and how it batches."""

    kv_cache_memory: int | None = option(
        None, "Bytes of latent KV cache per worker; auto: on a GPU, each worker's share of what the weights leave"
        " within --gpu-memory-utilization, 512MiB on CPU.", parse=parse_auto_size,
        show=lambda v: "auto" if v is None else show_size(v))
    gpu_memory_utilization: float = option(
        0.9, "Fraction of the GPU that weights, workers and their KV caches may use (auto KV cache).",
        bounds=(0.05, 1.0))
    kv_cache_dtype: str = option("auto", "auto: the model's dtype; fp8: e4m3 with a scale per cached vector.",
                                 choices=KV_CACHE_DTYPES)
    block_size: int = option(16, "Tokens per KV cache block.", bounds=(1, 1024))
    max_model_len: int | None = option(
        None, "Prompt + output tokens of one request at most [default: the model's context, or what the KV cache holds].",
        bounds=(1, None))
    max_num_seqs: int = option(256, "Sequences admitted (holding KV cache blocks) at most.", bounds=(1, None))
    max_num_batched_tokens: int = option(
        4096, "Tokens one engine step computes at most. Running streams wait out each step that carries a prompt's"
        " chunk: with prompt steps replayed and launched ahead (V2-Lite, docs/performance.md), 4096 served mixed"
        " traffic as fast as 2048 and a burst of prompts faster (fewer steps), its inter-token latency p99 37 ms"
        " against 30.", bounds=(1, None))
    max_num_active_seqs: int | None = option(
        None, "Sequences computed in one step at most; the admitted ones (up to --max-num-seqs) take turns"
        " [default: --max-num-seqs].", bounds=(1, None))
    long_prefill_token_threshold: int = option(
        0, "A prompt longer than this is prefilled in chunks of at most this many tokens, divided among the prefills"
        " waiting, so that short requests behind it are not starved (0: off).", bounds=(0, None))
    enforce_eager: bool = option(
        False, "Run every step eagerly: no CUDA graphs, of decode steps or of prompt steps' pieces (a faster start,"
               " slower steps).")
    async_scheduling: bool = option(
        True, "Launch each step (decode, prompt or mixed) on the GPU before the previous step's tokens reach the host,"
        " so that the host's work between steps overlaps the GPU's; a request ended by a stop token or string costs"
        " one step computed for nothing; draws that read the output on the host (grammars, logits processors) are made"
        " once the step before has landed, while the GPU computes the step; with speculative decoding, steps run one"
        " at a time unless --drafts-ahead (no effect on a CPU).", flag="--async-scheduling/--no-async-scheduling")
    drafts_ahead: bool = option(
        False, "With --speculative-config and --async-scheduling, launch drafted steps (a verify step and the drafter's"
        " steps) before the step in flight has landed too, their rows moved on on the GPU by the drafts that step"
        " keeps. Off by default: it adds host work to each step, and where the host's work outweighs the GPU's"
        " (the bundled model on an H100) steps took 2-3x longer; it can pay only where a step's GPU time hides it.",
        flag="--drafts-ahead/--no-drafts-ahead")
    logits_processors: tuple[str, ...] = option(
        (), "A logits processor applied to every request: module:Class, or module:Class={json args} (repeatable;"
        " see worker/engine/logits_processors.py).")
    speculative_config: str | None = option(
        None, 'Speculative decoding, as JSON: {"method": "mtp", "num_speculative_tokens": k} drafts k tokens a step'
        " with the checkpoint's MTP layer, verified in one pass of the model.")
    tensor_parallel_size: int = option(
        1, "Processes computing each worker's model together, each its share of the weights (heads, the feed-forward's"
        " intermediate dimension; the CPU's, over gloo, for now).", bounds=(1, None))
    enable_expert_parallel: bool = option(
        False, "With --tensor-parallel-size: each process holds whole routed experts, its share of them, rather than"
        " a share of every expert.")
    enable_prefix_caching: bool = option(
        True, "Share the KV cache of full blocks between requests that begin with the same tokens (and the same"
        " cache_salt).", flag="--enable-prefix-caching/--no-enable-prefix-caching")


@dataclass(frozen=True)
class WorkerOptions:
    """What every engine worker runs with: its engine and its HTTP face."""

    served_model_name: tuple[str, ...] = option(
        (), "Model id in the API (repeatable: each is served, the first is the one responses name) [default: the"
        " checkpoint dir's name].")
    api_key: str | None = option(
        None, "Clients must send `Authorization: Bearer KEY` to /v1/* (/health and /metrics stay open); also read from"
        " $PRELOAD_API_KEY or $VLLM_API_KEY, which keeps it off the command line others can see in ps.")
    allowed_origins: tuple[str, ...] = option(
        (), "CORS: origins whose browser pages may call the API (repeatable; * for any) [default: none, no CORS headers].")
    allowed_methods: tuple[str, ...] = option((), "CORS: methods allowed (repeatable) [default: *, with --allowed-origins].")
    allowed_headers: tuple[str, ...] = option((), "CORS: headers allowed (repeatable) [default: *, with --allowed-origins].")
    allow_credentials: bool = option(False, "CORS: let browsers send credentials.")
    chat_template: Path | None = option(None, "A jinja chat template file to render chats with instead of the checkpoint's.")
    enable_auto_tool_choice: bool = option(
        False, "Serve tool_choice \"auto\": the model's tool calls found in its text by --tool-call-parser.")
    tool_call_parser: str | None = option(
        None, "How the model writes tool calls: hermes (<tool_call>{...}</tool_call>) or deepseek_v3 (the format of"
        " DeepSeek-V3's and R1's chat templates).", choices=("hermes", "deepseek_v3"))
    reasoning_parser: str | None = option(
        None, "deepseek_r1: the reply's <think>...</think> part is returned as reasoning_content, apart from content.",
        choices=("deepseek_r1",))
    vllm_metrics: bool = option(
        False, "Also export /metrics under vLLM's names (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...), for"
        " dashboards, autoscalers and gateways that read those.")
    drain_timeout: float = option(30.0, "Seconds to finish in-flight requests on SIGTERM.", bounds=(0, None))
    max_request_bytes: int = option(4 << 20, "Largest request body.", parse=parse_size, show=show_size)
    trust_request_chat_template: bool = option(
        False, "Let requests supply chat_template / chat_template_kwargs (changes server-side rendering).")
    engine: EngineOptions = field(default_factory=EngineOptions)

    @property
    def key(self) -> str | None:
        """The API key in force: --api-key, else $PRELOAD_API_KEY or $VLLM_API_KEY."""
        return self.api_key or os.environ.get("PRELOAD_API_KEY") or os.environ.get("VLLM_API_KEY")


@dataclass(frozen=True)
class ServeOptions:
    """One worker attached to a daemon (`preload serve`, or each worker the daemon runs)."""

    state_dir: Path | None = option(None, STATE_DIR_HELP)
    model: Path | None = option(
        None, "The checkpoint: refuse to start unless the daemon holds exactly this one; with no daemon on the state"
        " dir, load it in this process (a copy of the weights of the worker's own) unless --require-daemon.")
    require_daemon: bool = option(False, "Refuse to start when no daemon answers on the state dir, instead of loading"
                                  " --model in this process.")
    host: str = option("127.0.0.1", "API host.")
    port: int = option(8000, "API port.", bounds=(0, 65535))
    worker: WorkerOptions = field(default_factory=WorkerOptions)
    # How many engines share the device's KV space (the daemon's --workers and --spare-workers).
    workers: int = option(1, cli=False)
    spares: int = option(0, cli=False)
    dp_rank: int = option(0, cli=False)  # which of the daemon's copies of the weights (--data-parallel-size) it maps


@dataclass(frozen=True)
class DaemonOptions:
    """`preload start`: the daemon, the weights it holds, and the workers it supervises."""

    model: Path | None = option(None, "Checkpoint dir [default: the bundled model].")
    quant: str = option("none", "How the stored weights are quantized.", choices=QUANT_MODES)
    device: str = option("auto", "auto, cpu or cuda:N (with --data-parallel-size: the first of consecutive GPUs).")
    data_parallel_size: int = option(
        1, "Copies of the weights, one per GPU (cuda:N, N+1, ...), each with its own --workers and --spare-workers"
        " behind the one API port (on the CPU: copies in host memory).", bounds=(1, 16))
    dtype: str = option("auto", "Dtype of unquantized weights: bf16 on CUDA, the checkpoint's on CPU.",
                        choices=("auto", *DTYPES))
    transport: str = option("auto", "How workers map the arena: memfd (host memory), cuda-vmm (GPU, read-only maps;"
                            " the CUDA default), cuda-ipc (legacy).", choices=("auto", *TRANSPORTS))
    state_dir: Path | None = option(None, STATE_DIR_HELP)
    health_host: str = option("127.0.0.1", "Host of /health, /status and /metrics.")
    health_port: int = option(8001, "Port of /health, /status and /metrics.", bounds=(0, 65535))
    allow_uid: tuple[int, ...] = option((), "Also let this uid attach (repeatable).")
    allow_gid: tuple[int, ...] = option((), "Also let members of this gid attach (repeatable).")
    workers: int = option(
        1, "Engine workers to run and supervise, on each copy of the weights (0: hold the weights only).", bounds=(0, 64))
    spare_workers: int | None = option(
        None, "Warm spare workers that take over a dead worker's slot at once, beside each copy of the weights"
        " [default: 1 on a GPU, 0 on CPU].", bounds=(0, 8))
    host: str = option("127.0.0.1", "API host of the workers.")
    port: int = option(8000, "API port, owned by the daemon.", bounds=(0, 65535))
    keeper: bool = option(True, "Keep the weights and the API socket in a small keeper process, so that a daemon"
                          " killed and started again on the same state dir takes them back instead of loading"
                          " (--no-keeper: they go with the daemon).", flag="--keeper/--no-keeper")
    zygote: bool = option(True, "Fork workers from a zygote that has imported everything (--no-zygote: start each"
                          " as a fresh interpreter, slower).", flag="--zygote/--no-zygote")
    restore: Path | None = option(None, "A snapshot (`preload snapshot DIR`, experimental: CRIU) whose zygote, its"
                                  " imports done, is restored instead of importing again; if it cannot be, the"
                                  " start goes on without it and says why.")
    worker_start_timeout: float = option(
        300.0, "Seconds a worker may take from its start to ready (a spare: to warm) before it is killed and replaced.",
        bounds=(1, None))
    worker_timeout: float = option(
        5.0, "A started worker that sends no heartbeat for this many seconds (stopped, frozen) is killed and replaced.",
        bounds=(1, None))
    engine_step_timeout: float = option(
        60.0, "A worker whose engine has work but finishes no step for this many seconds is killed and replaced.",
        bounds=(1, None))
    worker: WorkerOptions = field(default_factory=WorkerOptions)


def cli_fields(cls) -> list[tuple[tuple[str, ...], Any, Any]]:
    """(path, field, type) of every command-line field of `cls`, nested dataclasses
    flattened (a path is the attribute names from `cls` down to the field)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            out += [((f.name, *path), sub, kind) for path, sub, kind in cli_fields(hints[f.name])]
        elif f.metadata.get("cli", False):
            out.append(((f.name,), f, hints[f.name]))
    return out


def from_paths(cls, values: dict[tuple[str, ...], Any]):
    """An options dataclass from values keyed by `cli_fields` paths (others keep their defaults)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            kwargs[f.name] = from_paths(hints[f.name], {p[1:]: v for p, v in values.items() if p[0] == f.name})
        elif (f.name,) in values:
            kwargs[f.name] = values[(f.name,)]
    return cls(**kwargs)


def to_json(options) -> dict:
    """A JSON-able dict of an options dataclass (paths as strings, tuples as lists)."""
    return asdict(options, dict_factory=lambda items: {k: str(v) if isinstance(v, Path) else v for k, v in items})


def from_json(cls, data: dict):
    """The inverse of `to_json`; unknown keys are an error (a daemon and a zygote of
    different code versions must not silently disagree)."""
    hints = typing.get_type_hints(cls)
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown options {sorted(unknown)}")
    values = {}
    for name, value in data.items():
        kind = hints[name]
        if is_dataclass(kind):
            value = from_json(kind, value)
        elif value is not None and Path in typing.get_args(kind):
            value = Path(value)
        elif isinstance(value, list):
            value = tuple(value)
        values[name] = value
    return cls(**values)
