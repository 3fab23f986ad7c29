"""Rendering and reading back the Helm chart for tests/unit/deploy/test_chart.py: helm-python-sdk
(Helm's Go SDK in a shared library, offline) and kubernetes-validate (bundled schemas)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from capture_svc.config import CaptureConfig
from gateway.config import GatewayConfig
from readout_svc.config import ReadoutServiceConfig
from stateblock import settings
from stateblock.app.plan import PROCESSES, WIRING, Ports, StackPlan
from stateblock.settings import COMPUTED, OPTIONAL
from tests.helpers import REPO

CHART = REPO / "deploy" / "helm" / "stateblock"
KUBE_VERSION = "1.27.0"  # Chart.yaml kubeVersion's floor (native gRPC probes are GA there)
RELEASE, NAMESPACE = "sb", "ml"
CRD_API_VERSIONS = {
    "monitoring.coreos.com/v1",
    "keda.sh/v1alpha1",
}  # no bundled schema: checked structurally

CONFIGS = {"gateway": GatewayConfig, "capture": CaptureConfig, "readout": ReadoutServiceConfig}
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def value_at(key: str, values: dict = VALUES):
    """values.yaml's value at a dotted key ("serving.maxLanes")."""
    for part in key.split("."):
        values = values[part]
    return values


def values_with(key: str, value) -> dict:
    """The values overriding one dotted key."""
    out = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


# --- rendering --------------------------------------------------------------------------


def render(values: dict | None = None, chart: Path = CHART) -> list[dict]:
    """Every manifest the chart renders for `values` (NOTES.txt left out)."""
    with helm.Chart.load(chart) as loaded:
        out = loaded.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(out.items()):
        if not path.endswith("NOTES.txt"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def render_valid(values: dict | None = None, chart: Path = CHART) -> list[dict]:
    docs = render(values, chart)
    for doc in docs:
        if doc["apiVersion"] in CRD_API_VERSIONS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            name = f"{doc['kind']}/{doc['metadata']['name']}"
            raise AssertionError(f"{name}: {where}: {e.message}") from None
    return docs


def render_error(values: dict) -> str:
    with pytest.raises(helm.HelmError) as caught:
        render(values)
    return str(caught.value)


def kinds(docs: list[dict]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers_of(dep: dict) -> dict[str, dict]:
    return {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}


def deployment(docs: list[dict], component: str) -> dict:
    """The Deployment whose pods run `component`'s container: its own, or with placement
    pod the capture's for the readout."""
    (dep,) = [d for d in of_kind(docs, "Deployment").values() if component in containers_of(d)]
    return dep


def container(docs: list[dict], component: str) -> dict:
    return containers_of(deployment(docs, component))[component]


def env_of(docs: list[dict], component: str) -> dict[str, str]:
    """The container's env with values (entries from a Secret, valueFrom, left out)."""
    env = container(docs, component)["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)), f"duplicate env names: {names}"
    plain = [e for e in env if "valueFrom" not in e]
    assert all(set(e) == {"name", "value"} for e in plain), "env comes from values only"
    return {e["name"]: e["value"] for e in plain}


def env_from_secrets(docs: list[dict], component: str) -> dict[str, tuple[str, str]]:
    """name -> (Secret, key) of the container's env entries read from Secrets."""
    env = container(docs, component)["env"]
    refs = [(e["name"], e["valueFrom"]["secretKeyRef"]) for e in env if "valueFrom" in e]
    return {name: (ref["name"], ref["key"]) for name, ref in refs}


def volumes_by_mount(docs: list[dict], component: str) -> dict[str, dict]:
    """mountPath -> (the mount, merged with its pod volume)."""
    pod = deployment(docs, component)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {
        m["mountPath"]: {**volumes[m["name"]], **m}
        for m in container(docs, component)["volumeMounts"]
    }


def secrets_referenced(docs: list[dict], component: str) -> set[str]:
    """The Secrets `component`'s container reads: through the volumes it mounts, its env."""
    c = container(docs, component)
    volumes = volumes_by_mount(docs, component).values()
    names = {v["secret"]["secretName"] for v in volumes if "secret" in v}
    for v in volumes:
        for source in v.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    for e in c.get("env", []) + c.get("envFrom", []):
        ref = e.get("valueFrom", {}).get("secretKeyRef") or e.get("secretRef")
        if ref:
            names.add(ref["name"])
    return names


def gpus(docs: list[dict], component: str, resource: str = "nvidia.com/gpu") -> int:
    resources = container(docs, component)["resources"]
    assert resource not in resources.get("requests", {}), "extended resources go in limits"
    return resources.get("limits", {}).get(resource, 0)


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- the stack plan the chart deploys ----------------------------------------------------

# Config fields that name where a deployment puts a file or finds a peer (the chart's Secret
# mounts, its Services, its GPUs, one pod template for every replica): no plan sets them
# for Kubernetes, so the chart's own tests check them.
PLACED = {
    "gateway": {"capture_target", "capture_token_file", "readout_trusted_keys_dir"},
    "capture": {"host", "key_dir", "token_file", "device", "compile_cache"},
    "readout": {"trusted_keys_dir", "signing_key_dir", "readout_trusted_keys_dir", "device",
                "worker_id"},
}  # fmt: skip


def merged(base: dict, over: dict) -> dict:
    """`over` merged into `base` key by key, as Helm merges values into values.yaml."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(base[key], value) if isinstance(value, dict) and key in base else value
    return out


def default_env(component: str) -> set[str]:
    """The variables a component's container gets from values.yaml: those the declarations
    give the chart, and the capture's compile cache (the chart's capture runs on a GPU, so
    it compiles by default and keeps its caches on a volume)."""
    names = settings.chart_variables(component)
    return names | {settings.CAPTURE_COMPILE_CACHE.name} if component == "capture" else names


def chart_value(setting: settings.Setting, values: dict) -> object:
    """A setting's value in the chart's values; for a setting with no default of its own
    (STATEBLOCK_WORKERS), the chart's 0 leaves it to the service."""
    value = value_at(setting.chart, values)
    unset = setting.type is int and setting.default is None and value == 0
    return None if unset else value


def plan_for(values: dict | None = None) -> StackPlan:
    """The stack the chart should deploy for `values` (over values.yaml): processes on every
    interface of their pods, an external NATS, each port and setting the value the
    declarations' chart key names, the data plane the placement allows."""
    v = merged(VALUES, values or {})
    keyed = [s for s in settings.SETTINGS if s.chart not in ("", COMPUTED, OPTIONAL)]
    model = v["model"]
    pod = v["placement"] == "pod"  # a readout container in every capture pod
    c = v["capture"]["replicas"]
    n = c if pod else v["readout"]["replicas"]

    def port(setting: settings.Setting) -> int:
        return int(value_at(setting.chart, v))

    return StackPlan(
        data_dir=Path("/"),
        placement=PROCESSES,
        nats_url=v["nats"]["url"],
        captures=c,
        readout_procs=n,
        host="0.0.0.0",
        ports=Ports(
            http=port(settings.HTTP_PORT),
            grpc=port(settings.GRPC_PORT),
            capture=(port(settings.CAPTURE_PORT),) * c,
            capture_metrics=(port(settings.CAPTURE_METRICS_PORT),) * c,
            readout_metrics=(port(settings.READOUT_METRICS_PORT),) * n,
            readout_health=(port(settings.READOUT_HEALTH_PORT),) * n,
        ),
        values={
            **{s: chart_value(s, v) for s in keyed if s not in WIRING},
            settings.NATS_REPLICAS: max(1, v["nats"]["replicas"]),
            settings.DATA_PLANE: "host" if pod else "bus",
            settings.BASE_DIR: Path(model["mountPath"]) / model["baseDir"],
            settings.DECODER_DIR: Path(model["mountPath"]) / model["decoderDir"],
        },
    )
