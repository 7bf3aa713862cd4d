"""Triton's host code, built ahead with the kernels: the C helpers of its CUDA driver
(`cuda_utils`) and, on a Triton that compiles one per kernel signature (3.6, which the GPU
hosts run), each kernel's launcher. Triton builds both with the host's C compiler (-O3,
0.1-1 s each) at a process's first use of them and caches them beside the kernels. A
cache filled from a kernel list (ahead.py) held only the kernels, so a fresh host's first
worker still ran the C compiler on its way to ready: on an H100 (`preload bench cold`,
889c030) its batch-256 graph was captured in 2.3-3.0 s against 0.66 s warm and its first
batch-1 graph in 1.5 s against 0.06 s, with no kernel compiled.

Building needs no GPU, only libcuda.so.1 to link against and a C compiler: a GPU host has
both (`preload kernels compile` with no GPU visible, the zygote's compiles ahead); an
image's build often lacks the driver's library, and then the first start's compiles ahead
(ahead.compile_listed, beside the load) build them.
"""

from __future__ import annotations


def unbuildable() -> str | None:
    """Why Triton's host code cannot be built here (no libcuda.so.1 for the linker, as in
    an image's build), or None if it can."""
    try:
        from triton.backends.nvidia import driver

        driver.library_dirs()
    except Exception as e:  # noqa: BLE001 (Triton asserts there; ldconfig may be missing)
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return None


def build_driver_helpers() -> None:
    """The C module of Triton's CUDA driver (what its first kernel launch in a process
    builds, or loads from the cache)."""
    from triton.backends.nvidia import driver

    driver.CudaUtils()


def build_launcher(src, metadata) -> None:
    """The launcher a compiled kernel's first launch builds (CompiledKernel._init_handles:
    the same source and metadata, so the same cache key), where this Triton compiles one
    per signature; nothing where it launches every kernel through one generic launcher."""
    from triton.backends.nvidia import driver

    if hasattr(driver, "make_launcher"):
        driver.CudaLauncher(src, metadata)
