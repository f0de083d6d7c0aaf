"""deploy/: the Kubernetes manifests validate, the compose file and the image run real `shoal`
commands, and ports and probe paths agree with the CLI's defaults (read from the CLI itself).

The worker's SIGTERM drain, which the manifests' grace periods rely on, is tested with real
processes in tests/test_fleet.py::test_worker_drains_on_sigterm.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from shoal.cli import DEFAULT_HEALTH_URL, build_parser
from tests.kustomize import STRATEGIC_LIST_KEYS, load_objects, render

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu", "external-redis"]
KUBERNETES_VERSION = "1.30.0"  # the oldest release the manifests support (docs/deploy.md)
CUSTOM_KINDS = {"ServiceMonitor", "ScaledObject"}  # CRDs: kubernetes-validate has no schema


def _defaults(*argv: str) -> dict:
    """The parsed arguments of a `shoal` command line, defaults included."""
    return vars(build_parser().parse_args(list(argv)))


GATEWAY_PORT = _defaults("gateway", "--redis-url", "redis://x")["port"]
METRICS_BASE = _defaults("up")["metrics_port_base"]
PORTS = {"gateway": GATEWAY_PORT, "scheduler": METRICS_BASE, "worker": METRICS_BASE + 1,
         "jobs": METRICS_BASE}  # a job worker's metrics, in a pod or container of its own


def _parse_shoal_command(argv: list[str]) -> dict:
    """Ask the CLI: fails the test (argparse exits) on an unknown subcommand or flag."""
    try:
        return vars(build_parser().parse_args(argv))
    except SystemExit as e:
        pytest.fail(f"`shoal {' '.join(argv)}` is not a valid command line (exit {e.code})")


def _validate(obj: dict) -> None:
    if obj["kind"] in CUSTOM_KINDS:
        return  # checked against the objects they refer to in the tests below
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _base_manifests() -> list[Path]:
    k = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    return [K8S / "base" / r for r in k["resources"]]


@pytest.mark.parametrize("path", _base_manifests() + [K8S / "components/keda/scaledobject.yaml"],
                         ids=lambda p: p.name)
def test_every_manifest_validates(path):
    objs = load_objects(path)
    assert objs
    for obj in objs:
        _validate(obj)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_and_validates(overlay):
    objs = render(K8S / "overlays" / overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "ServiceMonitor", "ConfigMap", "Secret"} <= kinds
    for obj in objs:
        _validate(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "shoal"
    if overlay == "external-redis":
        assert not any(o["metadata"]["name"] == "shoal-redis" for o in objs)
    else:
        assert "StatefulSet" in kinds


def _normalized(objs: list[dict]) -> dict:
    def norm(x, field=None):
        if isinstance(x, dict):
            return {k: norm(v, k) for k, v in x.items()}
        if isinstance(x, list):
            items = [norm(v) for v in x]
            if field in STRATEGIC_LIST_KEYS:  # kustomize orders merged items its own way
                items.sort(key=lambda i: str(i.get(STRATEGIC_LIST_KEYS[field])))
            return items
        return x
    return {(o["kind"], o["metadata"]["name"]): norm(o) for o in objs}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_python_render_agrees_with_kubectl_kustomize(overlay):
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, check=True).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]
    assert _normalized(render(K8S / "overlays" / overlay)) == _normalized(theirs)


def _by(objs, kind, name=None):
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def _container(deployment):
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def _gateway_routes() -> set[str]:
    from gateway.app import create_app

    return set(create_app("redis://127.0.0.1:1/0").openapi()["paths"])


def test_manifest_ports_probes_and_commands_match_the_cli():
    objs = render(K8S / "overlays" / "cpu")
    routes = _gateway_routes()
    for part, port in PORTS.items():
        (dep,) = _by(objs, "Deployment", f"shoal-{part}")
        c = _container(dep)
        args = _parse_shoal_command(c["args"])
        assert args["command"] == part
        declared = {p["name"]: p["containerPort"] for p in c["ports"]}
        flag = "port" if part == "gateway" else "metrics_port"
        assert int(args[flag]) == port and port in declared.values()
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port)
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                get = c[probe]["httpGet"]
                assert declared[get["port"]] == port
                assert get["path"] in (routes if part == "gateway" else {"/metrics"})
        # Every Service port and ServiceMonitor endpoint names a port the pods declare.
        (svc,) = _by(objs, "Service", f"shoal-{part}")
        for p in svc["spec"]["ports"]:
            assert p["port"] == port and p["targetPort"] in declared
        (mon,) = _by(objs, "ServiceMonitor", f"shoal-{part}")
        assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert {e["port"] for e in mon["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    gateway = _container(_by(objs, "Deployment", "shoal-gateway")[0])
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_worker_pods_drain_safely_and_run_hardened():
    objs = render(K8S / "overlays" / "cpu")
    (worker,) = _by(objs, "Deployment", "shoal-worker")
    pod = worker["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 300  # the SIGTERM drain finishes generations
    (pdb,) = _by(objs, "PodDisruptionBudget", "shoal-worker")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    for dep in _by(objs, "Deployment"):
        spec = dep["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        c = _container(dep)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}
        assert c["resources"]["requests"] and c["resources"]["limits"]
        env = {e["name"]: e for e in c["env"]}
        assert env["SHOAL_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "shoal-redis"
    gpu = _container(_by(render(K8S / "overlays" / "gpu"), "Deployment", "shoal-worker")[0])
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1 and gpu["image"].endswith(":cuda")


def test_keda_scales_the_worker_deployment_on_waiting_requests():
    (scaled,) = load_objects(K8S / "components" / "keda" / "scaledobject.yaml")
    objs = render(K8S / "overlays" / "cpu")
    assert _by(objs, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    (trigger,) = scaled["spec"]["triggers"]
    from scheduler.metrics import REQUESTS_WAITING

    assert REQUESTS_WAITING._name in trigger["metadata"]["query"]
    k = yaml.safe_load((K8S / "components" / "keda" / "kustomization.yaml").read_text())
    assert k["kind"] == "Component" and k["resources"] == ["scaledobject.yaml"]


def test_grafana_dashboard_configmap_is_the_dashboard():
    objs = render(K8S / "overlays" / "cpu")
    (cm,) = _by(objs, "ConfigMap", "shoal-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["shoal-overview.json"] == (ROOT / "dashboards" / "shoal-overview.json").read_text()


def test_compose_services_run_real_shoal_commands():
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    services = compose["services"]
    shoal = {n: s for n, s in services.items() if s.get("image", "").startswith("shoal")}
    seen = {}
    for name, svc in shoal.items():
        args = _parse_shoal_command(svc["command"])
        seen.setdefault(args["command"], []).append(name)
        if args["command"] == "gateway":
            assert args["port"] == GATEWAY_PORT and args["host"] == "0.0.0.0"
            assert f"{GATEWAY_PORT}:{GATEWAY_PORT}" in svc["ports"]
        else:
            assert args["metrics_port"] == PORTS[args["command"]]
        if args["command"] == "jobs":
            gateways = [n for n, s in shoal.items() if s["command"][0] == "gateway"]
            assert args["gateway_url"] in {f"http://{g}:{GATEWAY_PORT}" for g in gateways}
        assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        assert (ROOT / "deploy" / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
    assert len(seen["gateway"]) == 1 and len(seen["scheduler"]) == 2 and len(seen["worker"]) == 2
    assert len(seen["jobs"]) == 1
    for w in seen["worker"]:
        assert services[w]["environment"]["SHOAL_HEALTH_URL"].endswith(f":{PORTS['worker']}/metrics")
    # Prometheus scrapes every shoal service on its port; Grafana mounts real files.
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "compose.yml").read_text())
    targets = {t for sc in prom["scrape_configs"] for sc2 in sc["static_configs"] for t in sc2["targets"]}
    for name, svc in shoal.items():
        part = _parse_shoal_command(svc["command"])["command"]
        if part in PORTS:
            assert f"{name}:{PORTS[part]}" in targets
    for volume in services["grafana"]["volumes"] + services["prometheus"]["volumes"]:
        assert (ROOT / "deploy" / volume.split(":")[0]).exists(), volume


def test_dockerfile_is_one_nonroot_image_with_a_real_healthcheck():
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+) AS (\S+)", text, re.M)
    assert len(stages) >= 4 and any("nvidia/cuda" in image for image, _ in stages)
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["shoal"\]$', text, re.M)
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1] not in ("root", "0")
    health = re.search(r"^HEALTHCHECK .* CMD (\[.*\])$", text, re.M)
    assert health and yaml.safe_load(health.group(1)) == ["shoal", "health"]
    _parse_shoal_command(["health"])
    assert DEFAULT_HEALTH_URL.endswith(f":{GATEWAY_PORT}/healthz") and "/healthz" in _gateway_routes()
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", text, re.M).group(1).split()}
    assert exposed == set(PORTS.values())
    cmd = yaml.safe_load(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    _parse_shoal_command(cmd)
    copied = set()
    for src in re.findall(r"^COPY (?!--from)(.*) \S+$", text, re.M):
        for item in src.split():
            assert (ROOT / item).exists(), item
            copied.add(item)
    # Every package the project installs is in the image (jobs/ was not: `shoal jobs worker`
    # failed to import in the container).
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= copied
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "tests"} <= set(ignored)
