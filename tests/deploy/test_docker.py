"""deploy/Dockerfile and .dockerignore, read as Docker would (no daemon needed): the image
installs preload the way the Makefile does on a CUDA PyTorch base, runs it as a fixed
non-root user, reports healthy only when a worker answers, and is built from a context
without the venv, the git history or build outputs."""

from __future__ import annotations

import http.server
import json
import re
import shlex
import socket
import subprocess
import sys
import threading
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version


def one(dockerfile, instruction: str) -> str:
    (args,) = [a for i, a in dockerfile if i == instruction]
    return args


def exec_form(args: str) -> list[str]:
    """A JSON-array instruction (ENTRYPOINT, CMD): the argv Docker runs, no shell between."""
    argv = json.loads(args)
    assert isinstance(argv, list), f"{args}: use the exec (JSON array) form"
    return argv


def arg(args: list[str], flag: str, default=None):
    return args[args.index(flag) + 1] if flag in args else default


def test_the_image_runs_as_a_fixed_non_root_user(dockerfile, image_user):
    """USER is a numeric uid:gid other than root's, created in the image, and owns the
    0700 directory the daemon's state dir goes in ($XDG_RUNTIME_DIR/preload), which the
    daemon refuses unless it is its own."""
    uid, gid = image_user
    assert uid != 0 and gid != 0
    runs = " ".join(a for i, a in dockerfile if i == "RUN")
    assert f"useradd --uid {uid} --gid {gid}" in runs and f"groupadd --gid {gid}" in runs
    runtime_dir = re.search(r"XDG_RUNTIME_DIR=(\S+)", " ".join(a for i, a in dockerfile if i == "ENV")).group(1)
    assert f"install -d -m 0700 -o {uid} -g {gid} {runtime_dir}" in runs


def test_it_installs_the_way_the_makefile_does(dockerfile, root):
    """A CUDA PyTorch runtime base whose torch satisfies preload's requirement (so nothing
    multi-GB is fetched); a venv in /opt/preload (where the systemd unit expects preload)
    that sees the base's torch; torch pinned, with the Makefile's pin, only where missing;
    then `pip install` of the project itself: not editable, no test extras."""
    base = re.search(r"^ARG BASE=(\S+)", "\n".join(f"{i} {a}" for i, a in dockerfile), re.M).group(1)
    assert one(dockerfile, "FROM") == "${BASE}"
    m = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", base)
    assert m, f"{base}: a pytorch/pytorch CUDA runtime image"
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    (torch,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    assert Version(m.group(1)) in torch.specifier, f"the base's torch {m.group(1)} does not satisfy {torch}"

    makefile_pin = re.search(r'import torch" 2>/dev/null \|\| \S*pip install -q (torch==\S+)',
                             (root / "Makefile").read_text()).group(1)
    runs = [a for i, a in dockerfile if i == "RUN"]
    assert "python3 -m venv --system-site-packages /opt/preload" in runs
    (install,) = [a for a in runs if "pip install" in a]
    assert install.startswith("--mount=type=bind,target=/src/preload,rw set -e;"), install
    assert re.search(r'/opt/preload/bin/python -c "import torch" 2>/dev/null \|\| '
                     rf"/opt/preload/bin/pip install --no-cache-dir {re.escape(makefile_pin)};", install), install
    assert install.endswith("/opt/preload/bin/pip install --no-cache-dir /src/preload"), install


def test_the_image_compiles_the_kernels_of_a_list_given_at_build_where_its_workers_look(dockerfile, tmp_path):
    """With --build-arg KERNEL_LIST=FILE the build runs `preload kernels compile` on that
    file of the context, as the image's user (after USER), into that user's kernel cache
    (~/.cache/preload/kernels, which the workers read); without it, nothing. The build
    step's shell is run here as Docker would run it (the context mounted at /src/preload)."""
    pytest.importorskip("triton")
    from kernel_specs import rms_norm_spec

    from preload.kernels import ahead

    instructions = [i for i, _ in dockerfile]
    (step,) = [(n, a) for n, (i, a) in enumerate(dockerfile) if i == "RUN" and "preload kernels compile" in a]
    assert step[0] > max(n for n, i in enumerate(instructions) if i == "USER"), "compiled as root: the workers' cache"
    assert any(i == "ARG" and a.startswith("KERNEL_LIST=") for i, a in dockerfile[:step[0]])
    mount, script = re.fullmatch(r"(--mount=type=bind,target=(\S+)) (.*)", step[1]).group(2, 3)
    context, home, bin_dir = tmp_path / "context", tmp_path / "home", tmp_path / "bin"
    for d in (context, home, bin_dir):
        d.mkdir(mode=0o700)
    spec = rms_norm_spec(True, 512)[0]
    (context / "kernels.json").write_text(json.dumps({"kernels": {ahead.entry_digest(spec): spec}}))
    (bin_dir / "preload").write_text(f"#!/bin/sh\nexec {sys.executable} -m preload.cli.main \"$@\"\n")
    (bin_dir / "preload").chmod(0o700)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": ":".join(sys.path)}
    script = script.replace(mount, str(context))
    for kernel_list in ("", "kernels.json"):
        r = subprocess.run(["sh", "-c", script], env=env | {"KERNEL_LIST": kernel_list}, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr[-2000:]
        cache = home / ".cache" / "preload" / "kernels"
        if not kernel_list:
            assert not cache.exists()
    assert "compiled 1 of 1" in r.stdout and len(list(cache.glob("*/*.cubin"))) == 1
    assert list(ahead.read_list(ahead.list_path(cache)).values()) == [spec]


def test_the_entrypoint_starts_the_daemon_in_the_foreground(dockerfile, start_flags):
    """`docker run IMAGE` runs `preload start --foreground` as PID 1 (its log on stderr,
    SIGTERM drains), with options `preload start` has, reachable from outside the
    container on the ports the image exposes; other args replace the CMD only."""
    assert exec_form(one(dockerfile, "ENTRYPOINT")) == ["/opt/preload/bin/preload"]
    args = exec_form(one(dockerfile, "CMD"))
    assert args[:2] == ["start", "--foreground"], args
    unknown = [a for a in args if a.startswith("--") and a not in start_flags]
    assert not unknown, f"preload start has no {unknown}"
    assert arg(args, "--host") == "0.0.0.0" and arg(args, "--health-host") == "0.0.0.0"
    exposed = {int(p) for p in one(dockerfile, "EXPOSE").split()}
    assert exposed == {int(arg(args, "--port", 8000)), int(arg(args, "--health-port", 8001))}


class Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def healthcheck_exit_code(dockerfile, status: int | None) -> int:
    """Run the HEALTHCHECK's command (this venv's python for the image's) against a local
    server answering /health with `status` on the port it asks (None: nothing listens)."""
    _, _, command = one(dockerfile, "HEALTHCHECK").partition(" CMD ")
    argv = exec_form(command)
    url = re.search(r"http://127\.0\.0\.1:(\d+)/health", argv[-1])
    assert argv[0] == "/opt/preload/bin/python" and url, argv
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = argv[-1].replace(url.group(0), f"http://127.0.0.1:{port}/health")
    server = None
    if status is not None:
        handler = type("H", (Health,), {"status": status})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        return subprocess.run([sys.executable, *argv[1:-1], code], timeout=30).returncode
    finally:
        if server:
            server.shutdown()
            server.server_close()


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False), (None, False)])
def test_healthy_only_when_the_api_ports_health_says_200(dockerfile, status, healthy):
    """`docker ps` shows healthy once a worker can answer (the API port's /health: 200);
    503 (loading, draining) or no answer is unhealthy. Python's urllib: the base has no curl."""
    assert (healthcheck_exit_code(dockerfile, status) == 0) is healthy


def test_the_healthcheck_allows_for_the_first_load(dockerfile):
    """Failures while a large checkpoint loads (up to 30 minutes) do not count, and the
    check asks the port the CMD's API listens on."""
    options, _, command = one(dockerfile, "HEALTHCHECK").partition(" CMD ")
    opts = dict(o.lstrip("-").split("=", 1) for o in shlex.split(options))
    assert opts["start-period"] == "30m"
    port = re.search(r"127\.0\.0\.1:(\d+)/health", command).group(1)
    assert int(port) == int(arg(exec_form(one(dockerfile, "CMD")), "--port", 8000))


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether Docker leaves `path` (relative to the context) out: a pattern matches it or
    a directory above it (Go's filepath.Match, plus `**` for any number of directories).
    Exceptions (`!`) are not used here, so not modelled."""
    def regex(pattern: str) -> str:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                out, i = out + pattern[i:end + 1], end + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return out

    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    return any(re.fullmatch(regex(p.strip("/")), prefix) for p in patterns for prefix in prefixes)


def test_the_build_context_has_what_pip_needs_and_nothing_else(root):
    """.dockerignore leaves out the venv (GBs), the git history, downloaded wheels,
    results, caches and build outputs (a stale egg-info or build/ would leak into the
    install), but keeps everything `pip install .` reads: pyproject.toml, the README it
    names, every package's modules and the bundled model."""
    patterns = [line.strip() for line in (root / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert ".venv" in patterns and ".git" in patterns
    assert not [p for p in patterns if p.startswith("!")], "exceptions are not modelled by this test"
    for left_out in [".venv/bin/python", ".git/HEAD", ".whl/fastapi-0.1-py3-none-any.whl", "results/cold.json",
                     "preload.egg-info/PKG-INFO", "build/lib/preload/options.py", "dist/preload-0.1.0.tar.gz",
                     "worker/__pycache__/serve.cpython-311.pyc", ".pytest_cache/v/cache", ".ruff_cache/x",
                     ".hypothesis/examples/x"]:
        assert dockerignore_excludes(patterns, left_out), f"{left_out} is sent to the build"

    setup = tomllib.loads((root / "pyproject.toml").read_text())
    package_dir = setup["tool"]["setuptools"]["package-dir"]["preload"]
    needed = ["pyproject.toml", setup["project"]["readme"]]
    for package in setup["tool"]["setuptools"]["packages"]:
        folder = root / package_dir / "/".join(package.split(".")[1:])
        needed += [str(f.relative_to(root)) for f in folder.glob("*.py")]
    needed += [str(f.relative_to(root)) for f in root.glob("bundled/*/*")]
    assert len(needed) > 20
    kept_out = [f for f in needed if dockerignore_excludes(patterns, f)]
    assert not kept_out, f"pip install . needs {kept_out}"
