"""The model's arithmetic: a torch reference for each operation, and beside it the Triton
kernel a GPU runs instead. The Triton modules are imported where they are first needed, so
that the CPU path never imports Triton; a zygote that forks GPU workers imports them ahead
(`triton_import_steps`)."""

import importlib
from collections.abc import Callable

TRITON_MODULES = ("cache_write", "fp8_act", "fp8_linear", "fused_moe", "fused_norm", "fused_rope", "fused_router",
                  "head_matvec", "launch", "mla_decode", "mla_prefill", "moe_align", "moe_decode", "moe_prefill",
                  "moe_sum", "split_k", "triton_dot")


def triton_import_steps() -> list[Callable[[], object]]:
    """Import Triton and every kernel module, and have Triton hash its own installation (the
    base of every kernel's cache key, computed once per process), all without touching CUDA,
    as steps of a fraction of a second each: a zygote runs them while it has no fork to
    serve, and no worker forked after them pays them at its first step (on the H200 host
    0.36 s of imports and 0.37 s of hashing; scripts/probe_worker_start.py)."""
    from functools import partial

    def hash_triton() -> None:
        from triton.runtime.cache import triton_key

        triton_key()

    return [partial(importlib.import_module, "triton"),
            *(partial(importlib.import_module, f"{__name__}.{name}") for name in TRITON_MODULES), hash_triton]
