"""A zygote that forks GPU workers imports the Triton kernels ahead (kernels/__init__.py):
every module that imports Triton is in the list it imports, and importing them, Triton's
own hash included, initializes no CUDA (a zygote that did could not fork)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import preload.kernels as kernels

PROBE = """
import sys
import torch
from preload.kernels import TRITON_MODULES, triton_import_steps
from triton.runtime.cache import triton_key
assert triton_key.cache_info().currsize == 0
for step in triton_import_steps():
    step()
assert all(f"preload.kernels.{name}" in sys.modules for name in TRITON_MODULES)
assert triton_key.cache_info().currsize == 1, triton_key.cache_info()
assert not torch.cuda.is_initialized()
print("ok")
"""


def test_every_module_that_imports_triton_is_imported_ahead():
    here = Path(kernels.__file__).parent
    importing = {p.stem for p in here.glob("*.py")
                 if any(line.startswith(("import triton", "from triton")) for line in p.read_text().splitlines())}
    assert importing == set(kernels.TRITON_MODULES)


def test_importing_them_hashes_triton_once_and_touches_no_cuda():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
