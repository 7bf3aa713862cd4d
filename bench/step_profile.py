"""Where an engine step's GPU time goes, by operation: the functions of `LABELS` are
wrapped so that each call records a CUDA event before and after it on the stream, and an
operation's time is the span between them less the spans of the labelled calls inside it
(its own time). The spans of one step add up to the step's time on the GPU's timeline,
idle gaps included: an operation whose launches outrun the GPU's work shows as slow.
The profiler, in further runs without the wrapping, gives what the GPU was busy with:
every kernel's time (`busy_kernels`), whichever way it was launched. (Its links from a
kernel to the op that launched it miss Triton's launches, so the spans above come from
events, not from it.)

The wrapping is the benchmark's own, for the timed runs only: the model runs as it
always does, and a change to it shows here as time left to "other", never as a wrong
figure for an operation.
"""

from __future__ import annotations

import functools
import importlib
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

# (module, attribute, label[, within]): the functions a step calls through these names, the
# operation each one is. A method is named as "Class.method"; a Triton kernel (launched
# as kernel[grid](...)) as its module attribute. With `within`, a call is told apart only
# directly inside a call of that label (the grouped GEMM of the routed experts, not the
# same kernel under an fp8 dense projection, whose time stays the projection's).
PROMPT = "attention: prompt (latent up-projection, state)"
LABELS = (
    ("preload.worker.model.deepseek", "linear", "dense projections"),
    ("preload.worker.model.deepseek", "swiglu", "dense MLP"),
    ("preload.kernels.moe", "swiglu", "shared experts"),
    ("preload.worker.model.deepseek", "route", "routing"),
    ("preload.kernels.fused_moe", "fused_moe", "routed experts"),
    ("preload.kernels.fused_moe", "align_by_expert_triton", "routed experts: alignment", "routed experts"),
    ("preload.kernels.fused_moe", "_grouped_gemm", "routed experts: grouped GEMMs", "routed experts"),
    ("preload.kernels.moe_prefill", "_expert_gemm", "routed experts: grouped GEMMs", "routed experts"),
    ("preload.kernels.moe_prefill", "_gather_rows", "routed experts: rows gathered", "routed experts"),
    ("preload.kernels.moe_decode", "moe_decode", "routed experts"),
    ("preload.worker.model.deepseek", "rms_norm", "norms"),
    ("preload.worker.model.deepseek", "add_rms_norm", "norms"),
    ("preload.worker.model.deepseek", "rope_qk", "rope"),
    ("preload.worker.model.kv_cache", "write_latents", "cache writes"),
    ("preload.kernels.mla_prefill", "mla_prefill", PROMPT),
    ("preload.kernels.mla_prefill", "chunk_latents", "attention: prompt, latent gather", PROMPT),
    ("preload.kernels.mla_prefill", "_prefill_chunk", "attention: prompt, flash", PROMPT),
    ("preload.worker.model.deepseek", "mla_decode", "attention: decode rows"),
    ("preload.worker.model.deepseek", "Transformer.logits", "output head"),
    ("preload.worker.engine.engine", "Engine.sample", "sampling"),
)
OTHER = "other (embedding, residuals, copies, gaps between labelled calls)"


class Spans:
    """Events around labelled calls, nested as the calls nest; `own_ms` once the GPU is done."""

    def __init__(self):
        self.calls: list[list] = []  # [label, start event, end event, index of the enclosing call or None]
        self.stack: list[int] = []

    @contextmanager
    def around(self, label: str, within: str | None = None):
        enclosing = self.stack[-1] if self.stack else None
        if within is not None and (enclosing is None or self.calls[enclosing][0] != within):
            yield  # not told apart here: its time stays with what encloses it
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self.calls.append([label, start, None, enclosing])
        self.stack.append(len(self.calls) - 1)
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.calls[self.stack.pop()][2] = end

    def own_ms(self) -> dict[str, float]:
        torch.cuda.synchronize()
        spans = [start.elapsed_time(end) for _, start, end, _ in self.calls]
        own = list(spans)
        for (_, _, _, parent), span in zip(self.calls, spans):
            if parent is not None:
                own[parent] -= span
        totals: dict[str, float] = defaultdict(float)
        for (label, *_), ms in zip(self.calls, own):
            totals[label] += ms
        return dict(totals)


class _LabelledKernel:
    """A Triton kernel whose launches (kernel[grid](...)) are spans."""

    def __init__(self, kernel, spans: Spans, *label: str):
        self.kernel, self.spans, self.label = kernel, spans, label

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def launched(*args, **kwargs):
            with self.spans.around(*self.label):
                return launch(*args, **kwargs)

        return launched


def _resolve(module: str, attribute: str) -> tuple[object, str]:
    owner = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


@contextmanager
def labelled(spans: Spans):
    """LABELS' functions recorded into `spans` while the block runs."""
    saved = []
    try:
        for module, attribute, *label in LABELS:
            owner, name = _resolve(module, attribute)
            fn = getattr(owner, name)
            saved.append((owner, name, fn))
            if hasattr(fn, "__getitem__") and hasattr(fn, "run"):  # a Triton kernel
                setattr(owner, name, _LabelledKernel(fn, spans, *label))
                continue

            def wrapped(*args, _fn=fn, _label=label, **kwargs):
                with spans.around(*_label):
                    return _fn(*args, **kwargs)

            setattr(owner, name, functools.wraps(fn)(wrapped))
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def operation_ms(step: Callable[[], None], times: int) -> tuple[dict[str, float], float]:
    """({operation: its own GPU-timeline milliseconds per step}, the step's whole span on
    the GPU's timeline per step, ms) over `times` runs of `step`; time outside every
    labelled call is OTHER."""
    spans = Spans()
    with labelled(spans), spans.around(OTHER):
        for _ in range(times):
            step()
    whole = spans.calls[0][1]
    own = spans.own_ms()
    total = whole.elapsed_time(spans.calls[0][2])
    return {label: ms / times for label, ms in own.items()}, total / times


def busy_kernels(step: Callable[[], None], times: int, top: int = 25) -> tuple[float, list[dict]]:
    """(GPU-busy ms per step, the `top` kernels by time per step) over `times` runs under the profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(times):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    busy = sum(e.self_device_time_total for e in kernels) / times / 1000
    return busy, [{"kernel": e.key[:100], "ms": e.self_device_time_total / times / 1000, "calls": e.count / times}
                  for e in kernels[:top]]
