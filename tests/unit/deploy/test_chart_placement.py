"""The chart's placements (`placement`): `apart`, a readout Deployment whose rows travel over
NATS, and `pod`, the readout workers as a second container of every capture pod, the rows in
the in-memory /dev/shm both containers mount (STATEBLOCK_DATA_PLANE=host: one placement,
stateblock/model/shm.py). Rendered and schema-checked like the rest of the chart."""

from __future__ import annotations

import pytest

from capture_svc.config import CaptureConfig
from readout_svc.config import ReadoutServiceConfig
from stateblock.nats_client import NatsOptions
from stateblock.protocol import locator
from tests.unit.deploy.chart import (
    RELEASE,
    container,
    containers_of,
    default_env,
    deployment,
    env_of,
    gpus,
    kinds,
    of_kind,
    render_error,
    render_valid,
    secrets_referenced,
    selects,
    volumes_by_mount,
)
from tests.unit.deploy.test_chart import nats_user

POD = {"placement": "pod"}
TOKEN = f"{RELEASE}-stateblock-capture-token"
CAPTURE_SECRETS = {"stateblock-signing-key", TOKEN, nats_user("capture")}
READOUT_SECRETS = {
    "stateblock-trusted-keys",
    "stateblock-readout-signing-key",
    "stateblock-readout-trusted-keys",
    nats_user("readout"),
}


@pytest.fixture(scope="module")
def pod_docs() -> list[dict]:
    return render_valid({**POD, "capture": {"replicas": 3}, "readout": {"replicas": 5}})


def pod_spec(docs: list[dict], component: str) -> dict:
    return deployment(docs, component)["spec"]["template"]["spec"]


def test_apart_runs_a_readout_deployment_over_the_bus():
    docs = render_valid()
    assert set(containers_of(deployment(docs, "readout"))) == {"readout"}
    assert set(containers_of(deployment(docs, "capture"))) == {"capture"}
    assert f"{RELEASE}-stateblock-readout" in of_kind(docs, "PodDisruptionBudget")
    for component in ("capture", "readout"):
        assert env_of(docs, component)["STATEBLOCK_DATA_PLANE"] == locator.BUS
        assert "/dev/shm" not in volumes_by_mount(docs, component)
        assert all(
            "medium" not in v.get("emptyDir", {}) for v in pod_spec(docs, component)["volumes"]
        )
    assert secrets_referenced(docs, "capture") == CAPTURE_SECRETS
    assert secrets_referenced(docs, "readout") == READOUT_SECRETS


def test_pod_runs_the_readout_beside_the_capture_in_one_deployment(pod_docs):
    deployments = of_kind(pod_docs, "Deployment")
    assert set(deployments) == {f"{RELEASE}-stateblock-gateway", f"{RELEASE}-stateblock-capture"}
    capture = deployment(pod_docs, "capture")
    assert deployment(pod_docs, "readout") is capture
    assert list(containers_of(capture)) == ["capture", "readout"]
    assert capture["spec"]["replicas"] == 3  # readout.replicas has no pods of its own
    # no readout Deployment to scale or budget: the capture's pods are the readout's
    assert [n for n in of_kind(pod_docs, "PodDisruptionBudget") if n.endswith("-readout")] == []
    assert not {"HorizontalPodAutoscaler", "ScaledObject"} & set(kinds(pod_docs))
    pod = pod_spec(pod_docs, "capture")
    names = [v["name"] for v in pod["volumes"]]
    assert len(names) == len(set(names)), names
    ports = [p for c in pod["containers"] for p in c["ports"]]
    assert len({p["name"] for p in ports}) == len({p["containerPort"] for p in ports}) == len(ports)


def test_pod_shares_an_in_memory_dev_shm_and_sets_the_host_plane(pod_docs):
    shm = [volumes_by_mount(pod_docs, c)["/dev/shm"] for c in ("capture", "readout")]
    assert shm[0]["name"] == shm[1]["name"]  # one volume: one placement for both
    assert shm[0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert (
        "readOnly" not in shm[0] and "readOnly" not in shm[1]
    )  # the capture writes, workers unlink
    capture = CaptureConfig.from_env(env_of(pod_docs, "capture"))
    readout = ReadoutServiceConfig.from_env(env_of(pod_docs, "readout"))
    assert capture.data_plane == readout.data_plane == locator.HOST
    sized = render_valid({**POD, "shmSizeLimit": "512Mi"})
    assert volumes_by_mount(sized, "readout")["/dev/shm"]["emptyDir"]["sizeLimit"] == "512Mi"


@pytest.mark.parametrize("component", ["capture", "readout"])
def test_pod_gives_each_container_exactly_what_its_service_reads(pod_docs, component):
    assert set(env_of(pod_docs, component)) == default_env(component)
    c = container(pod_docs, component)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] in {p["containerPort"] for p in c["ports"]}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert volumes_by_mount(pod_docs, component)["/models"]["readOnly"] is True


def test_pod_keeps_each_key_and_nats_user_in_its_own_container(pod_docs):
    assert secrets_referenced(pod_docs, "capture") == CAPTURE_SECRETS
    assert secrets_referenced(pod_docs, "readout") == READOUT_SECRETS
    for component in ("capture", "readout"):
        options = NatsOptions.of("nats://nats:4222", env_of(pod_docs, component))
        assert options.user == component
        mount = volumes_by_mount(pod_docs, component)[str(options.password_file.parent)]
        assert mount["secret"]["secretName"] == nats_user(component)


def test_pod_rolls_when_either_containers_keys_change(keypairs):
    docs = render_valid({**POD, **keypairs})
    annotations = deployment(docs, "readout")["spec"]["template"]["metadata"]["annotations"]
    assert {"checksum/signing-key", "checksum/trusted-keys"} <= set(annotations)
    signing = f"{RELEASE}-stateblock-signing-key"
    assert signing in secrets_referenced(docs, "capture")
    assert signing not in secrets_referenced(docs, "readout")
    assert f"{RELEASE}-stateblock-readout-signing-key" not in secrets_referenced(docs, "capture")


@pytest.fixture(scope="module")
def keypairs(tmp_path_factory) -> dict:
    from stateblock.protocol.keys import generate_keypair

    values = {}
    for name in ("keys", "readoutKeys"):
        files = generate_keypair(tmp_path_factory.mktemp(name))
        values[name] = {"create": True, "keyId": files.key_id,
                        "privateKey": files.private_path.read_text(),
                        "publicKey": files.public_path.read_text()}  # fmt: skip
    return values


def test_pod_readout_metrics_service_reaches_the_readout_container(pod_docs):
    service = of_kind(pod_docs, "Service")[f"{RELEASE}-stateblock-readout-metrics"]
    labels = deployment(pod_docs, "capture")["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], labels)
    (port,) = service["spec"]["ports"]
    named = {p["name"]: p["containerPort"] for p in container(pod_docs, "readout")["ports"]}
    assert named[port["targetPort"]] == port["port"]
    env = env_of(pod_docs, "readout")
    assert int(env["STATEBLOCK_READOUT_METRICS_PORT"]) == port["port"]


def test_pod_network_policy_opens_the_readout_containers_ports():
    docs = render_valid({**POD, "networkPolicy": {"enabled": True}})
    policies = of_kind(docs, "NetworkPolicy")
    assert set(policies) == {f"{RELEASE}-stateblock-gateway", f"{RELEASE}-stateblock-capture"}
    policy = policies[f"{RELEASE}-stateblock-capture"]["spec"]
    opened = {p["port"] for r in policy["ingress"] for p in r["ports"]}
    named = {p["name"] for c in pod_spec(docs, "capture")["containers"] for p in c["ports"]}
    assert opened <= named
    assert {p["name"] for p in container(docs, "readout")["ports"]} <= opened


def test_pod_scales_with_the_captures_autoscaling():
    scaling = {"minReplicas": 2, "maxReplicas": 6, "keda": {"enabled": True}}
    docs = render_valid({**POD, "capture": {"autoscaling": scaling}})
    (scaled,) = of_kind(docs, "ScaledObject").values()
    capture = deployment(docs, "capture")
    assert scaled["spec"]["scaleTargetRef"]["name"] == capture["metadata"]["name"]
    assert "replicas" not in capture["spec"]
    assert deployment(docs, "readout") is capture


def test_pod_readout_gpus_are_its_own():
    """The device plugin gives a GPU to one container: the readout's is asked for beside
    the capture's, never taken from it."""
    torch = render_valid({**POD, "readout": {"engine": "torch"}})
    assert (gpus(torch, "capture"), gpus(torch, "readout")) == (1, 1)
    assert ReadoutServiceConfig.from_env(env_of(torch, "readout")).device == "cuda"
    cpu = render_valid(POD)
    assert (gpus(cpu, "capture"), gpus(cpu, "readout")) == (1, 0)
    assert ReadoutServiceConfig.from_env(env_of(cpu, "readout")).device == "cpu"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"readout": {"autoscaling": {"enabled": True}}}, "capture.autoscaling scales those"),
        ({"readout": {"autoscaling": {"keda": {"enabled": True}}}}, "readout.autoscaling.keda"),
        (
            {"readout": {"ports": {"metrics": 9090}}},
            "capture.ports.metrics and readout.ports.metrics are both port 9090",
        ),
        ({"readout": {"ports": {"health": 50061}}}, "are both port 50061"),
    ],
)
def test_pod_refuses_values_one_pod_cannot_hold(values, message):
    assert message in render_error({**POD, **values})
    render_valid(values)  # apart, each is fine


def test_placement_and_shm_size_are_schema_checked():
    assert "/placement" in render_error({"placement": "node"})
    assert "/shmSizeLimit" in render_error({**POD, "shmSizeLimit": "lots"})


def test_pod_with_the_ipc_plane_keeps_the_rows_on_the_capture_s_gpu():
    docs = render_valid({**POD, "podDataPlane": "ipc", "readout": {"gpu": {"count": 1}}})
    capture = CaptureConfig.from_env(env_of(docs, "capture"))
    readout = ReadoutServiceConfig.from_env(env_of(docs, "readout"))
    assert capture.data_plane == readout.data_plane == locator.CUDA_IPC
    assert gpus(docs, "readout") == 1


@pytest.mark.parametrize(
    "values,reason",
    [
        ({"podDataPlane": "ipc"}, "needs placement pod"),
        ({**POD, "podDataPlane": "ipc"}, "readout.gpu.count 1"),
        ({**POD, "podDataPlane": "bus"}, "podDataPlane"),
    ],
    ids=["apart", "no_readout_gpu", "unknown"],
)
def test_an_ipc_plane_the_pod_cannot_serve_is_refused_with_the_value_to_fix(values, reason):
    assert reason in render_error(values)
