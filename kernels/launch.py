"""Triton launches with the JIT's bookkeeping done once per kind of call.

`kernel[grid](...)` goes through Triton's JITFunction.run at every launch: it binds and
specializes each argument, builds the cache key, checks the kernel's globals, and only
then calls the compiled kernel's launcher. On the GPU hosts that took 27-62 us a launch
against 13-27 us for the launcher alone (H100, scripts/probe_launch.py). Launches
under CUDA graphs pay it once, at capture; the attention between a prompt step's
replayed pieces (prompt_graphs.py) pays it five times a layer, and there the host, not
the GPU, set the pace of a step that mixes prompt chunks and decode rows; a step run
eagerly (a drafter's prompt steps, `--enforce-eager`) pays it at each of its ~1,100
launches. Every kernel of this package launches through it.

`launcher(kernel)[grid](*args, **constexprs)` launches as `kernel[grid]` does: the
first call of a kind goes through the JIT (which compiles if it must) and keeps the
compiled kernel's launcher, later calls of that kind go straight to it. Two calls are of
one kind when only the addresses of their tensors differ, each as aligned to 16 bytes as
before: Triton specializes a tensor on its dtype and on that alignment, any other
argument on its value, so both calls compile to one kernel. Finding the kind is this
module's own cost, Python at each launch: on an H100 host at 7dec262 a kept launch took
26.8 us against the launcher's 12.9 alone (scripts/probe_launch.py, `_head_matvec`), so
it is kept lean (`_kinds`: 5.3 -> 3.9 us on the CPU machine). What is not the JIT's kernel
(Triton's interpreter's, in the CPU tests; a benchmark's wrapper that times each launch,
bench/step_profile.py) is launched as it is.
"""

from __future__ import annotations

import torch
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

KINDS_KEPT = 64  # kinds of call a kernel keeps before forgetting them all (batch sizes make new ones)
# By the kernel's id: a JITFunction hashes its source's cache key under a lock (0.5 us a
# launch); the Launcher holds the kernel, so no other object takes its id.
_LAUNCHERS: dict[int, Launcher] = {}


def _kind(arg) -> object:
    """What of an argument decides the compiled kernel (with its value for the rest)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, TensorDescriptor):  # (its shape, strides, block shape... all kept as values)
        return (arg.base.dtype, arg.base.data_ptr() % 16 == 0,
                *((k, tuple(v) if isinstance(v, list) else v) for k, v in vars(arg).items() if k != "base"))
    return type(arg), arg  # (True == 1 == 1.0 in Python; Triton compiles i1, i32 and fp32 apart)


def _kinds(args: tuple) -> tuple:
    """_kind of each argument, the common ones (tensors, ints) inline: this is most of a kept
    launch's own Python, and a call per argument cost about as much again."""
    return tuple([(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a if type(a) is int
                  else _kind(a) for a in args])


def launcher(kernel):
    """The kernel's Launcher (one a kernel), or the kernel itself where it is not the JIT's."""
    if not isinstance(kernel, JITFunction):
        return kernel
    found = _LAUNCHERS.get(id(kernel))
    if found is None:
        found = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    return found


class Launcher:
    """A JIT kernel launched as `launcher[grid](*args, **keywords)` (see the module)."""

    def __init__(self, kernel: JITFunction):
        self.kernel, self.names = kernel, kernel.arg_names
        self.kept: dict[tuple, object] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **keywords: self.launch(tuple(grid), args, keywords)

    def launch(self, grid: tuple[int, ...], args: tuple, keywords: dict) -> None:
        kind = (torch.cuda.current_device(), grid, _kinds(args), tuple(keywords.items()))
        kept = self.kept.get(kind)
        if kept is None:
            compiled = self.kernel[grid](*args, **keywords)  # the JIT's own launch (and compile)
            if len(self.kept) >= KINDS_KEPT:
                self.kept.clear()
            rest = self.names[len(args):]
            if all(name in keywords for name in rest):  # (else a default was taken: JIT always)
                # The launcher takes every parameter in order, constexprs too (they are in its
                # signature); those passed by name are part of the kind, so kept with it.
                self.kept[kind] = compiled[grid + (1,) * (3 - len(grid))], tuple(keywords[name] for name in rest)
            return
        run, named = kept
        run(*args, *named)
