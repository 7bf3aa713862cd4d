"""What is installed: a version of the code that workers run (a zygote that imported
other code is renewed: zygote.py; a snapshot of other code is not restored: snapshot.py),
one of the packages they import, and whether its interpreters compile torch from source at
every import."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
WORKER_CODE = ("kernels", "checkpoint", "ipc", "preloadd", "worker")  # what a forked worker runs


def code_version() -> str:
    """Changes when the installed code that workers run changes: the zygote must then be renewed."""
    h = hashlib.sha256()
    files = [*PACKAGE_ROOT.glob("*.py"), *(p for d in WORKER_CODE for p in (PACKAGE_ROOT / d).rglob("*.py"))]
    for path in sorted(files):
        st = path.stat()
        h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def compiles_from_source(module: str = "torch") -> bool:
    """Whether every fresh interpreter here compiles `module` from source: no cached bytecode
    where this Python looks for it, and none written (PYTHONDONTWRITEBYTECODE, or a read-only
    cache folder). Only the package's first file is looked at; nothing is imported. The H200
    machine's image was such an install: `import torch` took 4.3-5.1 s there, 2.0 s once
    compiled (`python -m compileall`)."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    cached = importlib.util.cache_from_source(spec.origin)  # under PYTHONPYCACHEPREFIX when set
    if os.path.exists(cached):
        return False
    if sys.dont_write_bytecode:
        return True
    folder = os.path.dirname(cached)  # its __pycache__, or the prefix's mirror of its folder
    while not os.path.isdir(folder):  # made at the first write: then where it would be made
        folder = os.path.dirname(folder)
    return not os.access(folder, os.W_OK)


def uncompiled_imports() -> list[str]:
    """What every fresh interpreter here compiles again (compiles_from_source): torch, and the
    standard library (json standing for it). A PYTHONPYCACHEPREFIX makes Python look for all
    bytecode under the prefix, the standard library's too, so a prefix filled with torch's
    alone leaves the library compiled at every start (`preload --help` on the CPU machine:
    0.07 s, 0.29 s with an empty prefix)."""
    return [name for module, name in (("torch", "torch"), ("json", "the standard library"))
            if compiles_from_source(module)]


def packages_version() -> str:
    """Changes when a package on the interpreter's path is installed, removed or upgraded
    (their dist-info folders name each package and its version): a snapshot holds the code
    that its imports read, torch's and the rest, besides ours."""
    # (sys.path[0] is the script's folder or the working directory: where the command ran from)
    names = sorted({entry for folder in sys.path[1:] if os.path.isdir(folder)
                    for entry in os.listdir(folder) if entry.endswith((".dist-info", ".egg-info"))})
    return hashlib.sha256("\n".join([sys.version, *names]).encode()).hexdigest()
