"""`preload bench`: benchmarks that print a table and write JSON (DESIGN.md, "Benchmarks")."""

from __future__ import annotations

import functools

import json
import signal
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import click

from preload.options import QUANT_MODES, DaemonOptions, EngineOptions


def _quant_list(ctx, param, value: str) -> list[str]:
    quants = [q.strip() for q in value.split(",") if q.strip()]
    bad = [q for q in quants if q not in QUANT_MODES]
    if bad or not quants:
        raise click.BadParameter(f"{', '.join(bad) or value!r}: choose from {', '.join(QUANT_MODES)}")
    return quants


def _progress(msg: str) -> None:
    click.echo(f"... {msg}", err=True)


def _report(result: dict, format_table, json_path: Path) -> None:
    click.echo(format_table(result))
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    click.echo(f"\nwrote {json_path}")


def json_option(name: str):
    return click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
                        default=Path(f"bench-{name}.json"), show_default=True, help="Where to write the results.")


model_option = click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
                            help="Checkpoint dir [default: the bundled model].")


def _model_path(model: Path | None) -> Path:
    from preload.options import BUNDLED_MODEL

    return Path(model or BUNDLED_MODEL).absolute()


def _run(run, format_table, json_path: Path, *args) -> None:
    """`run(*args, progress)`, its table printed and its JSON written; its errors one line."""
    try:
        result = run(*args, _progress)
    except (OSError, RuntimeError, ValueError, TimeoutError) as e:
        raise click.ClickException(str(e)) from None
    _report(result, format_table, json_path)


device_option = click.option("--device", default=DaemonOptions().device, show_default=True,
                             help="Passed to `preload start --device`.")


def model_sizes(command):
    """The small and the large model a restart or memory benchmark runs on."""
    for decorate in reversed((
        click.option("--small", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
                     help="The small model [default: the bundled one, else a tiny random checkpoint]."),
        click.option("--large", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="A model of >= 1 GB; V2-Lite's shapes cut to ~1.2 GB (random weights) are written there"
                          " unless it exists [default: written to a temporary dir, removed afterwards]."),
        click.option("--no-large", is_flag=True, help="Only the small model."),
        click.option("--no-small", is_flag=True, help="Only the large model."),
    )):
        command = decorate(command)
    return command


@contextmanager
def chosen_models(small: Path | None, large: Path | None, no_small: bool, no_large: bool):
    """(label, dir) of each model to measure; what had to be written is removed afterwards."""
    from preload.bench.checkpoint import large_model, small_model

    if no_small and no_large:
        raise click.UsageError("--no-small and --no-large leave nothing to measure")
    with tempfile.TemporaryDirectory(prefix="preload-bench-models-") as work:
        models = [] if no_small else [("small", small) if small else small_model(Path(work))]
        if not no_large:
            _progress(f"large model: {large or 'V2-Lite shapes, ~1.2 GB, written to a temporary dir'}")
            models.append(large_model(large or Path(work) / "v2-lite-mini"))
        yield models


@click.group()
def bench() -> None:
    """Benchmarks: print a table, write JSON."""
    # `timeout`, a job's runner or a kill stops a run with SIGTERM, which by default ends
    # Python where it stands: the daemons it started (detached, their own sessions) would
    # run on, holding the GPU. As an exit instead, the `finally`s on the way out stop them.
    signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum, frame) -> None:
    sys.exit(128 + signum)


@bench.command()
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Checkpoint dir [default: the bundled model].")
@click.option("--quant", default=",".join(QUANT_MODES), show_default=True, callback=_quant_list,
              help="Comma-separated quant modes to start the daemon with.")
@click.option("--repeat", type=click.IntRange(1), default=3, show_default=True, help="Runs per measurement.")
@click.option("--workers", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Engine workers to start with (`preload start` then returns once they are ready).")
@device_option
@click.option("--evict", is_flag=True, help="Drop the checkpoint from the page cache before the first read.")
@click.option("--no-warmup", is_flag=True, help="Skip the unrecorded warm-up launch.")
@click.option("--transformers", "with_transformers", is_flag=True,
              help="Also time transformers from_pretrained on the same files (needs transformers).")
@click.option("--snapshot", is_flag=True, help="Also take `preload snapshot` and time the same starts with --restore"
              " (needs --workers and a CRIU that passes `criu check`).")
@json_option("cold")
def cold(model, quant, repeat, workers, device, evict, no_warmup, with_transformers, snapshot, json_path):
    """Cold start: `preload start` to ready per quant mode, vs reading the checkpoint files alone."""
    from preload.bench.cold import format_table, run_cold
    from preload.options import BUNDLED_MODEL

    if snapshot and not workers:
        raise click.UsageError("--snapshot restores a zygote, which forks workers: give --workers")
    try:
        result = run_cold(Path(model or BUNDLED_MODEL), quant, repeat=repeat, device=device, evict=evict,
                          warmup=not no_warmup, transformers=with_transformers, workers=workers,
                          snapshot=snapshot, progress=_progress)
    except (OSError, RuntimeError, TimeoutError) as e:
        raise click.ClickException(str(e)) from None
    _report(result, format_table, json_path)


@bench.command()
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Checkpoint dir [default: the bundled model].")
@click.option("--quant", default="none", show_default=True, callback=_quant_list, help="Comma-separated quant modes.")
@click.option("--batch", default="1,16,64,256", show_default=True, help="Comma-separated batch sizes.")
@click.option("--context", default="1024", show_default=True, help="Comma-separated prompt lengths (tokens).")
@click.option("--output-len", type=click.IntRange(2), default=128, show_default=True, help="Tokens generated per sequence.")
@click.option("--transformers", "with_transformers", is_flag=True,
              help="Also time transformers generate on the same file (batches up to 16, the first context).")
@click.option("--enforce-eager", is_flag=True, help="No CUDA graphs: every step eager (as a worker with --enforce-eager).")
@click.option("--no-async-scheduling", is_flag=True,
              help="Decode steps one at a time (as a worker with --no-async-scheduling), not launched ahead.")
@click.option("--profile", is_flag=True, help="Also profile a few decode steps per batch (first context): top kernels.")
@click.option("--speculative-tokens", default="0", show_default=True,
              help="Comma-separated MTP draft counts to measure (0: no speculative decoding).")
@click.option("--draft-model", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Draft with this checkpoint (same vocabulary) instead of the MTP layer.")
@click.option("--drafts-ahead", is_flag=True, help="Launch drafted steps ahead too (as a worker with --drafts-ahead).")
@click.option("--max-batch-tokens", type=click.IntRange(1), default=None,
              help="Skip the (batch, context) cases whose batch x context exceeds this [default: run all].")
@device_option
@json_option("decode")
def decode(model, quant, batch, context, output_len, with_transformers, enforce_eager, no_async_scheduling, profile,
           speculative_tokens, draft_model, drafts_ahead, max_batch_tokens, device, json_path):
    """Decode speed: tok/s and ms per step by batch and context, vs the bandwidth limit and transformers."""
    from preload.bench.decode import format_table, run_decode
    from preload.options import BUNDLED_MODEL

    try:
        batches, contexts = _int_list(batch, "--batch"), _int_list(context, "--context")
        cases = [(b, c) for c in contexts for b in batches if max_batch_tokens is None or b * c <= max_batch_tokens]
        if not cases:
            raise click.BadParameter("every case exceeds it", param_hint="--max-batch-tokens")
        drafts = tuple(_int_list(speculative_tokens, "--speculative-tokens", minimum=0))
        result = run_decode(Path(model or BUNDLED_MODEL), device, quant, cases, output_len,
                            with_transformers, _progress, enforce_eager=enforce_eager, profile=profile,
                            speculative=drafts, draft_model=draft_model, async_scheduling=not no_async_scheduling,
                            drafts_ahead=drafts_ahead)
    except (OSError, RuntimeError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    _report(result, format_table, json_path)


@bench.command()
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Checkpoint dir, loaded in this process.")
@click.option("--shape", type=click.Choice(["v2-lite", "v2-lite-mini", "v3-slice"]), default=None,
              help="Instead of --model: random weights of make-checkpoint's shape, drawn in GPU memory (no files).")
@click.option("--quant", default="none", show_default=True, callback=_quant_list, help="Comma-separated quant modes.")
@click.option("--cases", default=None,
              help="Comma-separated steps, each TOKENSxSEQS[cCACHED][+ROWS@CONTEXT] (e.g. 2048x8+64@1024: 2048 prompt"
                   " tokens over 8 sequences beside 64 decode rows at 1024 tokens of context) [default: a sweep].")
@click.option("--prompt", "prompts", default="32768", show_default=True,
              help="Comma-separated prompt lengths timed whole, from admission to the first token (0: none).")
@click.option("--max-num-batched-tokens", type=click.IntRange(1), default=EngineOptions().max_num_batched_tokens,
              show_default=True, help="The engine's token budget a step (the whole prompts' chunks).")
@click.option("--repeat", type=click.IntRange(1), default=5, show_default=True, help="Timed runs of each step.")
@click.option("--enforce-eager", is_flag=True, help="No prompt graphs: every step eagerly (as --enforce-eager serves).")
@device_option
@json_option("prefill")
def prefill(model, shape, quant, cases, prompts, max_num_batched_tokens, repeat, enforce_eager, device, json_path):
    """Prefill speed: steps of prompt tokens (with cached context, beside decode rows) timed and broken down by
    operation, vs the GPU's compute limit."""
    from preload.bench.prefill import DEFAULT_CASES, Case, format_table, run_prefill

    if (model is None) == (shape is None):
        raise click.UsageError("give --model or --shape")
    try:
        chosen = [Case.parse(c) for c in (cases.split(",") if cases else DEFAULT_CASES)]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--cases") from None
    lengths = [n for n in _int_list(prompts, "--prompt", minimum=0) if n]
    _run(functools.partial(run_prefill, graphs=not enforce_eager), format_table, json_path, model, shape, device, quant,
         chosen, lengths, max_num_batched_tokens, repeat)


def _int_list(text: str, option: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        raise click.BadParameter(f"{text!r}: integers >= {minimum}, comma-separated", param_hint=option)
    return values


@bench.command("serve")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="A running worker (`preload serve`).")
@click.option("--requests", "n_requests", type=click.IntRange(1), default=64, show_default=True, help="Recorded requests.")
@click.option("--concurrency", type=click.IntRange(1), default=8, show_default=True, help="Clients sending at once.")
@click.option("--prompt-len", default="64:256", show_default=True, help="Prompt tokens, uniform in LO:HI (or one number).")
@click.option("--output-len", default="32:128", show_default=True, help="Output tokens, uniform in LO:HI (or one number).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--vocab", type=click.IntRange(1), default=None,
              help="Prompt token ids are drawn from [0, VOCAB) [default: found by asking the worker].")
@click.option("--warmup", type=click.IntRange(0), default=1, show_default=True, help="Unrecorded requests sent first.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds per request.")
@click.option("--rolling-restarts", type=click.IntRange(0), default=0, show_default=True,
              help="Then run the same requests again while `preload restart` replaces every worker this many times.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The state dir of the daemon whose workers serve --url (for --rolling-restarts).")
@click.option("--extra-body", default=None, metavar="JSON",
              help="A JSON object merged into every request's body, e.g. '{\"frequency_penalty\": 0.1}' to time"
                   " penalized requests (not the fields the bench sets: model, prompt, max_tokens, ignore_eos, stream).")
@json_option("serve")
def serve(url, n_requests, concurrency, prompt_len, output_len, seed, vocab, warmup, timeout, rolling_restarts,
          state_dir, extra_body, json_path):
    """Serving load: concurrent streamed completions against a running worker."""
    import asyncio
    import json

    import aiohttp

    from preload.bench.serve import format_table, parse_range, request_fields, run_load

    try:
        p_len, o_len = parse_range(prompt_len), parse_range(output_len)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    try:
        extra = json.loads(extra_body) if extra_body else None
        request_fields("", extra)
    except ValueError as e:  # (json.JSONDecodeError is one)
        raise click.BadParameter(str(e), param_hint="--extra-body") from None
    if rolling_restarts and state_dir is None:
        raise click.UsageError("--rolling-restarts needs the daemon's --state-dir")
    try:
        result = asyncio.run(run_load(url, n_requests, concurrency, p_len, o_len, seed, vocab, warmup, timeout,
                                      rolling_restarts, state_dir and str(state_dir), progress=_progress,
                                      extra_body=extra))
    except (aiohttp.ClientError, OSError, RuntimeError, ValueError) as e:
        raise click.ClickException(f"{url}: {e}") from None
    _report(result, format_table, json_path)


@bench.command("restart")
@click.option("--restarts", type=click.IntRange(1), default=10, show_default=True, help="Restarts of each kind.")
@click.option("--cold-repeat", type=click.IntRange(1), default=3, show_default=True, help="Cold starts to time.")
@click.option("--kinds", default="sigkill-spare,sigkill,graceful,sigkill-no-zygote", show_default=True,
              help="Comma-separated kinds of restart to run.")
@model_sizes
@device_option
@json_option("restart")
def restart(restarts, cold_repeat, kinds, small, large, no_large, no_small, device, json_path):
    """Restart: worker SIGKILL (a warm spare takes over, a zygote fork, no zygote) or `preload restart`
    to /health 200 from the new worker, vs cold start."""
    from preload.bench.restart import KINDS, format_table, run_restart

    chosen = tuple(k.strip() for k in kinds.split(",") if k.strip())
    if not chosen or set(chosen) - set(KINDS):
        raise click.BadParameter(f"choose from {', '.join(KINDS)}", param_hint="--kinds")
    with chosen_models(small, large, no_small, no_large) as models:
        try:
            result = run_restart(models, restarts, cold_repeat, device, _progress, chosen)
        except (OSError, RuntimeError, TimeoutError) as e:
            raise click.ClickException(str(e)) from None
    _report(result, format_table, json_path)


@bench.command("failover")
@model_option
@click.option("--clients", default="8,64", show_default=True, help="Comma-separated numbers of concurrent clients.")
@click.option("--kills", type=click.IntRange(1), default=20, show_default=True, help="SIGKILLs of the engine core.")
@click.option("--max-tokens", type=click.IntRange(1), default=64, show_default=True, help="Tokens per completion.")
@click.option("--spare-workers", type=click.IntRange(0), default=1, show_default=True,
              help="Warm spare cores (0: the zygote forks each replacement).")
@click.option("--speculative-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="MTP drafts a step (the checkpoint's MTP layer): kills land mid-drafting too.")
@device_option
@json_option("failover")
def failover(model, clients, kills, max_tokens, spare_workers, speculative_tokens, device, json_path):
    """Failover: clients' requests while the engine core is SIGKILLed again and again: failures, outputs, pauses."""
    from preload.bench.failover import format_table, run_failover

    _run(run_failover, format_table, json_path, _model_path(model), device, _int_list(clients, "--clients"), kills,
         max_tokens, spare_workers, speculative_tokens)


@bench.command("readopt")
@model_option
@click.option("--repeat", type=click.IntRange(1), default=5, show_default=True, help="Daemon SIGKILLs and starts.")
@device_option
@json_option("readopt")
def readopt(model, repeat, device, json_path):
    """A daemon SIGKILLed and started again: the kept weights, port and worker taken back, vs a cold start."""
    from preload.bench.readopt import format_table, run_readopt

    _run(run_readopt, format_table, json_path, _model_path(model), device, repeat)


@bench.command("sleep")
@model_option
@click.option("--levels", default="1,2", show_default=True, help="Comma-separated sleep levels to cycle through.")
@click.option("--cycles", type=click.IntRange(1), default=20, show_default=True, help="Sleeps and wakes per level.")
@click.option("--spare-workers", type=click.IntRange(0), default=1, show_default=True,
              help="Spares beside the one worker (asleep, they go too).")
@device_option
@json_option("sleep")
def sleep(model, levels, cycles, spare_workers, device, json_path):
    """Sleep and wake: time to asleep, wake to serving, device memory freed, leaks over cycles."""
    from preload.bench.sleep import format_table, run_sleep

    try:
        chosen = [int(x) for x in levels.split(",") if x.strip()]
    except ValueError:
        chosen = []
    if not chosen or set(chosen) - {1, 2}:
        raise click.BadParameter(f"{levels!r}: levels 1 and/or 2, comma-separated", param_hint="--levels")
    _run(run_sleep, format_table, json_path, _model_path(model), device, chosen, cycles, spare_workers)


@bench.command("prefix")
@model_option
@click.option("--system-tokens", type=click.IntRange(16), default=2048, show_default=True,
              help="Length of the shared system prompt.")
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True, help="Repeated requests timed.")
@click.option("--conversations", type=click.IntRange(1), default=4, show_default=True, help="Chats replayed.")
@click.option("--turns", type=click.IntRange(1), default=4, show_default=True, help="Turns per chat.")
@device_option
@json_option("prefix")
def prefix(model, system_tokens, repeats, conversations, turns, device, json_path):
    """Prefix caching: TTFT of a shared system prompt, first vs repeated, and a chat replay's hit rate."""
    from preload.bench.prefix import format_table, run_prefix

    _run(run_prefix, format_table, json_path, _model_path(model), device, system_tokens, repeats, conversations, turns)


@bench.command("scheduling")
@model_option
@click.option("--count", type=click.IntRange(1), default=64, show_default=True, help="Long prompts, and short ones.")
@click.option("--long-len", type=click.IntRange(2), default=1024, show_default=True, help="Tokens of a long prompt.")
@click.option("--short-len", type=click.IntRange(1), default=16, show_default=True, help="Tokens of a short prompt.")
@click.option("--threshold", type=click.IntRange(1), default=256, show_default=True,
              help="The --long-prefill-token-threshold measured against none.")
@device_option
@json_option("scheduling")
def scheduling(model, count, long_len, short_len, threshold, device, json_path):
    """Short requests queued behind long ones: their TTFT with and without the long-prefill threshold."""
    from preload.bench.scheduling import format_table, run_scheduling

    _run(run_scheduling, format_table, json_path, _model_path(model), device, count, long_len, short_len, threshold)


@bench.command("memory")
@click.option("--workers", type=click.IntRange(2, 64), default=4, show_default=True,
              help="Measure with this many workers too (beside 1 worker, and 1 worker and a spare).")
@model_sizes
@device_option
@json_option("memory")
def memory(workers, small, large, no_large, no_small, device, json_path):
    """Memory: host (and on CUDA device) memory of the daemon, each worker and a spare, with 1 and N workers."""
    from preload.bench.memory import format_table, run_memory

    with chosen_models(small, large, no_small, no_large) as models:
        try:
            result = run_memory(models, workers, device, _progress)
        except (OSError, RuntimeError, TimeoutError) as e:
            raise click.ClickException(str(e)) from None
    _report(result, format_table, json_path)
