"""deploy/kubernetes.yaml, checked offline: every document is valid for the Kubernetes
version named here (kubernetes-validate ships the API schemas; strict: a misspelt or
misplaced field is an error, not silently dropped by the API server), and the pod does
what an operator is promised: it loads, is probed, drains and runs unprivileged."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from preload.options import WorkerOptions

MANIFEST = Path(__file__).parents[2] / "deploy" / "kubernetes.yaml"
# The oldest minor the manifest is meant for (still under the large clouds' support in
# 2026); every field used here exists there. Raise it with the manifest, not to pass.
KUBERNETES = "1.33.0"
STARTUP_BUDGET_S = 1800  # the first load of a large checkpoint, as the systemd unit allows it
DAEMON_STOP_MARGIN_S = 20  # after --drain-timeout: 5 s for the workers, 15 s for the supervisor


def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def document_id(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


@pytest.fixture(scope="module")
def pod() -> dict:
    (deployment,) = [d for d in documents() if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    (container,) = pod["containers"]
    return container


def arg(args: list[str], flag: str, default=None):
    return args[args.index(flag) + 1] if flag in args else default


@pytest.mark.parametrize("doc", documents(), ids=document_id)
def test_every_document_is_valid_kubernetes(doc):
    """`kubectl apply` takes each document as written: checked against the API's own
    schemas for that version, rejecting unknown fields."""
    try:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{document_id(doc)} at {'.'.join(map(str, e.path))}: {e.message}")


def test_the_container_runs_preload_start_with_flags_it_knows(container, start_flags):
    """The image's entrypoint is `preload`; the args are a foreground `preload start`
    whose every option exists, listening on all interfaces so that probes and the
    Service reach it (the defaults, 127.0.0.1, are unreachable from outside the pod)."""
    args = container["args"]
    assert args[:2] == ["start", "--foreground"], args
    unknown = [a for a in args if a.startswith("--") and a not in start_flags]
    assert not unknown, f"preload start has no {unknown}"
    assert arg(args, "--host") == "0.0.0.0" and arg(args, "--health-host") == "0.0.0.0"


def test_probes_the_daemon_for_liveness_and_a_worker_for_readiness(container):
    """Startup, then liveness: the daemon's /health (its weights resident), with time to
    load; readiness: the API port's /health (a worker answers correctly now), so the
    Service sends requests only to a pod that can serve them."""
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert ports["api"] == int(arg(args, "--port", 8000)) and ports["health"] == int(arg(args, "--health-port", 8001))
    for probe, port in [("startupProbe", "health"), ("livenessProbe", "health"), ("readinessProbe", "api")]:
        assert container[probe]["httpGet"] == {"path": "/health", "port": port}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= STARTUP_BUDGET_S


def test_a_rollout_is_not_called_failed_while_the_weights_load():
    """The Deployment's progress deadline outlasts the startup probe's budget."""
    (deployment,) = [d for d in documents() if d["kind"] == "Deployment"]
    assert deployment["spec"]["progressDeadlineSeconds"] > STARTUP_BUDGET_S


def test_a_deleted_pod_drains_within_its_grace_period(pod, container):
    """Deletion: the preStop hook keeps the workers serving while the endpoints update,
    then SIGTERM makes the daemon drain (in-flight requests finish, up to --drain-timeout)
    and exit. The grace period covers both and the daemon's reaping, so no request is cut
    by the final SIGKILL."""
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    m = re.fullmatch(r"sleep (\d+)", " ".join(command))
    assert m, f"preStop {command}: a pause while the endpoints update (the drain itself follows on SIGTERM)"
    drain = float(arg(container["args"], "--drain-timeout", WorkerOptions().drain_timeout))
    assert pod["terminationGracePeriodSeconds"] > int(m.group(1)) + drain + DAEMON_STOP_MARGIN_S


def test_it_needs_a_gpu_and_no_host_namespaces(pod, container):
    """One GPU, requested through the device plugin; the weights are shared through fds
    inside the pod, so neither the host's IPC nor its PID namespace (nor its network) is
    asked for, and nothing runs privileged."""
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    for host in ("hostIPC", "hostPID", "hostNetwork"):
        assert not pod.get(host), f"{host} is not needed"
    assert not container.get("securityContext", {}).get("privileged")


def test_it_runs_as_the_images_non_root_user(pod, container, image_user):
    """runAsNonRoot with the uid/gid the Dockerfile creates (its state dir belongs to
    them); no privilege escalation, no capabilities."""
    pod_security, security = pod["securityContext"], container["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert (pod_security["runAsUser"], pod_security["runAsGroup"]) == image_user
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]


def test_the_service_sends_clients_to_the_api_port():
    """The Service exposes the API port (by name), never the daemon's health port."""
    (service,) = [d for d in documents() if d["kind"] == "Service"]
    (deployment,) = [d for d in documents() if d["kind"] == "Deployment"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["api"]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
