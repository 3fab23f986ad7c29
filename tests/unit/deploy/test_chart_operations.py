"""The Helm chart, continued: GPUs, toggles, model sources, invalid values, day-one
operability (secrets, KEDA, NetworkPolicy, helm test) and the stack plan; rendered offline and
schema-validated as in test_chart.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from capture_svc.config import CaptureConfig
from readout_svc.config import ReadoutServiceConfig
from stateblock.app.plan import Wiring
from stateblock.nats_client import parse_servers
from tests.unit.deploy.chart import (
    CHART,
    CONFIGS,
    KUBE_VERSION,
    NAMESPACE,
    PLACED,
    RELEASE,
    container,
    containers_of,
    deployment,
    env_of,
    gpus,
    kinds,
    merged,
    of_kind,
    plan_for,
    render,
    render_error,
    render_valid,
    secrets_referenced,
    selects,
    volumes_by_mount,
)

# --- GPUs ---------------------------------------------------------------------------------


def test_gpu_only_on_capture_by_default(default_docs):
    assert gpus(default_docs, "capture") == 1
    assert gpus(default_docs, "gateway") == 0
    assert gpus(default_docs, "readout") == 0
    tolerations = deployment(default_docs, "capture")["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_gpu_follows_engine_and_values():
    torch = render_valid({"readout": {"engine": "torch"}})
    assert gpus(torch, "readout") == 1 and gpus(torch, "gateway") == 0
    assert ReadoutServiceConfig.from_env(env_of(torch, "readout")).device == "cuda"

    cpu_only = render_valid({"capture": {"device": "cpu", "dtype": "float32", "gpu": {"count": 0}}})
    assert all(gpus(cpu_only, c) == 0 for c in CONFIGS)
    assert CaptureConfig.from_env(env_of(cpu_only, "capture")).device == "cpu"

    other = render_valid(
        {
            "capture": {"gpu": {"count": 2, "resourceName": "amd.com/gpu"}},
            "readout": {"engine": "torch", "gpu": {"count": 0}},
        }
    )
    assert gpus(other, "capture", "amd.com/gpu") == 2 and gpus(other, "capture") == 0
    assert gpus(other, "readout") == 0
    assert ReadoutServiceConfig.from_env(env_of(other, "readout")).device == "cpu"


# --- toggles ------------------------------------------------------------------------------


def test_autoscaling_renders_an_hpa_for_readout():
    docs = render_valid({"readout": {"autoscaling": {"enabled": True, "maxReplicas": 5}}})
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{RELEASE}-stateblock-readout",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    assert "replicas" not in deployment(docs, "readout")["spec"]  # the HPA owns it


def test_service_monitors_scrape_each_metrics_port():
    docs = render({"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}})
    monitors = of_kind(docs, "ServiceMonitor")
    assert len(monitors) == 3
    services = of_kind(docs, "Service")
    scraped = set()
    for monitor in monitors.values():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "prom"
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        (svc,) = [
            s
            for s in services.values()
            if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
        scraped.add(svc["metadata"]["labels"]["app.kubernetes.io/component"])
    assert scraped == set(CONFIGS)
    render_valid({"serviceMonitor": {"enabled": True}})  # the rest still validates


def test_nats_dependency_is_optional_and_jetstream_enabled(chart_with_nats_stub):
    (dep,) = yaml.safe_load((CHART / "Chart.yaml").read_text())["dependencies"]
    assert (dep["name"], dep["condition"]) == ("nats", "nats.enabled")
    with helm.Chart.load(CHART) as chart:
        assert chart.values["nats"]["enabled"] is False
        assert chart.values["nats"]["config"]["jetstream"]["enabled"] is True

    external = render_valid({"nats": {"url": "nats://nats.infra:4222"}}, chart_with_nats_stub)
    assert "ConfigMap" not in kinds(external)
    assert {env_of(external, c)["STATEBLOCK_NATS_URL"] for c in CONFIGS} == {
        "nats://nats.infra:4222"
    }

    bundled = render_valid({"nats": {"enabled": True}}, chart_with_nats_stub)
    (config,) = of_kind(bundled, "ConfigMap").values()
    assert config["data"]["jetstream"] == "true"
    assert f"{RELEASE}-nats" in of_kind(bundled, "Service")
    urls = {env_of(bundled, c)["STATEBLOCK_NATS_URL"] for c in CONFIGS}
    assert urls == {f"nats://{RELEASE}-nats.{NAMESPACE}.svc:4222"}


@pytest.mark.parametrize(
    ("values", "replicas"),
    [
        ({}, 1),  # an external server of unknown size: one copy unless told
        ({"nats": {"url": "nats://a:4222,nats://b:4222,nats://c:4222", "replicas": 3}}, 3),
        ({"nats": {"enabled": True}}, 3),  # the bundled chart's 3-node cluster
        ({"nats": {"enabled": True, "config": {"cluster": {"enabled": False}}}}, 1),
        ({"nats": {"enabled": True, "replicas": 5}}, 5),
    ],
)
def test_every_service_replicates_streams_as_the_nats_cluster_allows(
    chart_with_nats_stub, values, replicas
):
    docs = render_valid(values, chart_with_nats_stub)
    for component, read in CONFIGS.items():
        env = env_of(docs, component)
        assert env["STATEBLOCK_NATS_REPLICAS"] == str(replicas)
        assert read.from_env(env).nats_replicas == replicas
    if "url" in values.get("nats", {}):
        urls = parse_servers(env_of(docs, "gateway")["STATEBLOCK_NATS_URL"])
        assert urls == ("nats://a:4222", "nats://b:4222", "nats://c:4222")


def test_a_nats_url_list_must_be_urls(chart_with_nats_stub):
    assert "/nats/url" in render_error({"nats": {"url": "nats://a:4222,b:4222"}})


@pytest.mark.parametrize("values", [None, {"placement": "pod"}], ids=["apart", "pod"])
def test_helm_lint_is_clean(chart_with_nats_stub, values):
    # The stand-in subchart only silences "missing dependency: nats" (nothing is fetched).
    report = helm.lint(chart_with_nats_stub, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not problems and not report["errors"], report


# --- model sources ------------------------------------------------------------------------


def test_model_from_host_path_or_image():
    host = render_valid({"model": {"source": "hostPath", "hostPath": {"path": "/srv/models"}}})
    for component in CONFIGS:
        mount = volumes_by_mount(host, component)["/models"]
        assert mount["hostPath"]["path"] == "/srv/models" and mount["readOnly"] is True

    baked = render_valid(
        {"model": {"source": "image", "mountPath": "/opt/model", "decoderDir": "/opt/dec"}}
    )
    for component in CONFIGS:
        assert "/opt/model" not in volumes_by_mount(baked, component)
        config = CONFIGS[component].from_env(env_of(baked, component))
        assert (str(config.base_dir), str(config.decoder_dir)) == ("/opt/model/base", "/opt/dec")


# --- invalid values fail with a message that names them ----------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"readout": {"engine": "bogus"}}, "value must be one of 'reference', 'onnx', 'torch'"),
        ({"readout": {"leaseSeconds": 20}}, "readout.ackWaitSeconds (15) must exceed"),
        ({"graceSeconds": 20}, "graceSeconds (20) must be below terminationGracePeriodSeconds"),
        ({"model": {"name": "a b"}}, "/model/name"),
        ({"model": {"source": "hostPath"}}, "model.hostPath.path is required"),
        ({"model": {"source": "nfs"}}, "/model/source"),
        ({"capture": {"gpu": {"count": 0}}}, "capture.device is cuda but capture.gpu.count is 0"),
        (
            {"capture": {"env": {"STATEBLOCK_DEVICE": "cpu"}}},
            "capture.env.STATEBLOCK_DEVICE is set by the chart",
        ),
        ({"gateway": {"env": {"HOME": "/tmp"}}}, "does not match pattern '^STATEBLOCK_"),
        ({"nats": {"url": ""}}, "/nats/url"),
        ({"keys": {"create": True}}, 'keys.keyId "" must be the 16-hex-digit id'),
        ({"readoutKeys": {"create": True}}, 'readoutKeys.keyId "" must be the 16-hex-digit id'),
        ({"readoutKeys": {"signingSecret": ""}}, "readoutKeys.signingSecret and"),
        ({"readout": {"workers": -1}}, "/readout/workers"),
        (
            {"readout": {"ackWaitSeconds": 40}},
            "readout.ackWaitSeconds (40) must be at most half of gateway.requestTimeoutSeconds",
        ),
        ({"capture": {"dtype": "int8"}}, "/capture/dtype"),
        ({"capture": {"laneBuckets": "1,,4"}}, "/capture/laneBuckets"),
    ],
)
def test_invalid_values_fail_rendering(values, message):
    assert message in render_error(values)


def test_keys_create_needs_the_pem_files(keypair):
    key_id, private_pem, public_pem = keypair
    base = {"create": True, "keyId": key_id, "privateKey": private_pem, "publicKey": public_pem}
    assert "keys.privateKey" in render_error({"keys": {**base, "privateKey": public_pem}})
    assert "keys.publicKey" in render_error({"keys": {**base, "publicKey": ""}})


def test_capture_service_is_headless_so_gateways_balance_over_its_pods(default_docs):
    services = of_kind(default_docs, "Service")
    capture = [s for n, s in services.items() if n.endswith("-capture")]
    assert len(capture) == 1 and capture[0]["spec"]["clusterIP"] == "None"
    target = env_of(default_docs, "gateway")["STATEBLOCK_CAPTURE_TARGET"]
    assert target.split(":")[0] == capture[0]["metadata"]["name"]  # resolves to every pod


def test_readout_probes_ask_the_workers_own_health_check(default_docs):
    env = env_of(default_docs, "readout")
    port = int(env["STATEBLOCK_READOUT_HEALTH_PORT"])
    assert ReadoutServiceConfig.from_env(env).health_port == port
    (container,) = deployment(default_docs, "readout")["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, probe
    assert container["livenessProbe"]["grpc"]["service"] == "liveness"
    assert "service" not in container["readinessProbe"]["grpc"]


@pytest.mark.parametrize("component", ["gateway", "capture", "readout"])
def test_liveness_never_restarts_a_pod_for_a_nats_outage(default_docs, component):
    """Readiness follows NATS; liveness asks the 'liveness' health service, SERVING while
    the process answers, so an outage takes pods out of service without restarting them."""
    (container,) = deployment(default_docs, component)["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["grpc"]["service"] == "liveness"


# what a compiled capture needs before it is ready: a warm-up of about 4 minutes (issue 38:
# ready within 3 on the H200) and the model's load
CAPTURE_WARM_UP_S = 240
CAPTURE_MODEL_LOAD_S = 120


def test_capture_startup_probe_waits_out_the_warm_up(default_docs):
    """The startup probe asks "" (NOT_SERVING until every compiled shape has warmed up) and
    its budget covers the warm-up; liveness and readiness start only after it succeeds."""
    (container,) = deployment(default_docs, "capture")["spec"]["template"]["spec"]["containers"]
    startup = container["startupProbe"]
    assert "service" not in startup["grpc"]  # the warm-up-aware status, not liveness
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= CAPTURE_WARM_UP_S + CAPTURE_MODEL_LOAD_S, budget
    env = env_of(
        render_valid(
            {"capture": {"compile": "reduce-overhead", "laneBuckets": "2,8", "cohortLanes": 8}}
        ),
        "capture",
    )
    assert CaptureConfig.from_env(env).cohort_lane_buckets == (2, 8)


def test_a_hugging_face_style_model_name_deploys():
    docs = render_valid({"model": {"name": "org/model-v2.1"}})
    for component, config in CONFIGS.items():
        assert config.from_env(env_of(docs, component)).model_name == "org/model-v2.1"


# --- day-one operability: secrets, extra env, KEDA, NetworkPolicy, helm test, model fill ---


def test_nats_credentials_tls_and_the_api_key_come_from_secrets():
    from tests.unit.deploy.chart import env_from_secrets

    docs = render_valid({
        "natsClient": {"credsSecret": "nats-user", "tlsSecret": "nats-ca", "tlsClientCert": True},
        "auth": {"apiKeySecret": {"name": "sb-api", "key": "token"}},
    })  # fmt: skip
    for component in CONFIGS:
        env = env_of(docs, component)
        mounts = volumes_by_mount(docs, component)
        creds = env["STATEBLOCK_NATS_CREDS"]
        assert mounts[str(Path(creds).parent)]["secret"]["secretName"] == "nats-user"
        for name in (
            "STATEBLOCK_NATS_TLS_CA",
            "STATEBLOCK_NATS_TLS_CERT",
            "STATEBLOCK_NATS_TLS_KEY",
        ):
            assert mounts[str(Path(env[name]).parent)]["secret"]["secretName"] == "nats-ca"
        assert {"nats-user", "nats-ca"} <= secrets_referenced(docs, component)
        secret_env = env_from_secrets(docs, component)
        # the key only where it is checked: the gateway
        assert ("STATEBLOCK_API_KEY" in secret_env) == (component == "gateway")
    assert env_from_secrets(docs, "gateway")["STATEBLOCK_API_KEY"] == ("sb-api", "token")
    # the services read what the chart sets: the NATS options through NatsOptions.of
    from stateblock.nats_client import NatsOptions

    opts = NatsOptions.of("nats://x:4222", env_of(docs, "readout"))
    assert opts.creds_file and opts.tls_ca_file and opts.tls_cert_file and opts.tls_key_file


def test_extra_env_volumes_and_mounts_reach_every_service():
    from tests.unit.deploy.chart import env_from_secrets

    extra_env = [{"name": "HF_HUB_OFFLINE", "value": "1"},
                 {"name": "STATEBLOCK_X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]  # fmt: skip
    docs = render_valid({
        "extraEnv": extra_env,
        "extraVolumes": [{"name": "cache", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "cache", "mountPath": "/cache"}],
    })  # fmt: skip
    for component in CONFIGS:
        assert env_of(docs, component)["HF_HUB_OFFLINE"] == "1"
        assert env_from_secrets(docs, component)["STATEBLOCK_X"] == ("s", "k")
        assert "emptyDir" in volumes_by_mount(docs, component)["/cache"]


def test_keda_scales_the_readout_on_its_consumer_lag():
    from stateblock.protocol import streams

    name = "org/model-v2.1"
    keda = {"enabled": True, "natsMonitoringEndpoint": "nats.infra.svc:8222", "lagThreshold": 6}
    docs = render_valid({"model": {"name": name}, "readout": {"autoscaling": {"keda": keda}}})
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    assert "HorizontalPodAutoscaler" not in kinds(docs)  # KEDA owns the HPA
    assert "replicas" not in deployment(docs, "readout")["spec"]
    assert (
        scaled["spec"]["scaleTargetRef"]["name"] == deployment(docs, "readout")["metadata"]["name"]
    )
    (trigger,) = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "nats-jetstream" and meta["stream"] == streams.BLOCKS_STREAM
    # the chart derives the consumer name exactly as the services do
    assert meta["consumer"] == streams.readout_durable(name)
    assert meta["natsServerMonitoringEndpoint"] == "nats.infra.svc:8222"
    assert meta["lagThreshold"] == "6"
    both = {"readout": {"autoscaling": {"enabled": True, "keda": {"enabled": True}}}}
    assert "choose one" in render_error(both)


def test_keda_scales_the_capture_on_the_requests_waiting_for_it():
    name = "org/model-v2.1"
    scaling = {"minReplicas": 2, "maxReplicas": 6,
               "keda": {"enabled": True, "prometheusServerAddress": "http://prom:9090"}}  # fmt: skip
    docs = render_valid({"model": {"name": name}, "capture": {"autoscaling": scaling}})
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    capture = deployment(docs, "capture")
    assert "replicas" not in capture["spec"]  # KEDA owns the count
    assert scaled["spec"]["scaleTargetRef"]["name"] == capture["metadata"]["name"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 6)
    (trigger,) = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "prometheus" and meta["serverAddress"] == "http://prom:9090"
    # the gauge the gateways export, for this release's namespace and served model
    assert meta["query"].startswith("sum(stateblock:num_requests_waiting{")
    assert f'model_name="{name}"' in meta["query"] and meta["threshold"] == "32"
    # scaled-out pods get traffic: gateways reconnect and resolve the Service again
    assert env_of(docs, "capture")["STATEBLOCK_CAPTURE_MAX_CONNECTION_AGE_S"] == "60"
    custom = merged(scaling, {"keda": {"query": "sum(up)", "waitingPerReplica": 8}})
    (scaled,) = of_kind(render_valid({"capture": {"autoscaling": custom}}), "ScaledObject").values()
    assert scaled["spec"]["triggers"][0]["metadata"]["query"] == "sum(up)"
    assert scaled["spec"]["triggers"][0]["metadata"]["threshold"] == "8"
    upside_down = {"capture": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}
    assert "must not exceed" in render_error(upside_down)
    assert "ScaledObject" not in kinds(render_valid({}))


def test_network_policies_fence_capture_behind_the_gateway():
    docs = render_valid({"networkPolicy": {"enabled": True, "metricsFrom": [
        {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]}})  # fmt: skip
    policies = of_kind(docs, "NetworkPolicy")
    assert len(policies) == 3
    capture = policies[f"{RELEASE}-stateblock-capture"]["spec"]
    grpc_rule = next(r for r in capture["ingress"] if r["ports"] == [{"port": "grpc"}])
    (peer,) = grpc_rule["from"]
    gateway_pods = deployment(docs, "gateway")["spec"]["template"]["metadata"]["labels"]
    assert selects(peer["podSelector"]["matchLabels"], gateway_pods)
    capture_pods = deployment(docs, "capture")["spec"]["template"]["metadata"]["labels"]
    assert selects(capture["podSelector"]["matchLabels"], capture_pods)
    gateway = policies[f"{RELEASE}-stateblock-gateway"]["spec"]
    assert "from" not in gateway["ingress"][0]  # anyone may call the API by default
    # every port a policy names is a named port of the pods it selects
    for component in CONFIGS:
        named = {p["name"] for p in container(docs, component)["ports"]}
        policy = policies[f"{RELEASE}-stateblock-{component}"]["spec"]
        assert {p["port"] for r in policy["ingress"] for p in r["ports"]} <= named


def test_helm_test_pod_asks_the_gateway():
    docs = render_valid({"auth": {"apiKeySecret": {"name": "sb-api"}}})
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    gateway = of_kind(docs, "Service")[f"{RELEASE}-stateblock-gateway"]
    assert f"http://{gateway['metadata']['name']}:8000" in c["args"][0]
    compile(c["args"][0], "helm-test", "exec")  # the script is valid Python
    assert c["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "sb-api"
    assert "Pod" not in kinds(render_valid({"helmTest": {"enabled": False}}))


def test_an_init_container_fills_the_model_volume_from_the_image():
    docs = render_valid({"model": {"fillFromImage": True}})
    for component in CONFIGS:
        pod = deployment(docs, component)["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["image"] == container(docs, component)["image"]
        assert init["volumeMounts"] == [{"name": "model", "mountPath": "/fill"}]
        assert "cp -a /models/. /fill/" in init["command"][-1]
        volume = next(v for v in pod["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"]["readOnly"] is False  # the init writes it
        assert volumes_by_mount(docs, component)["/models"]["readOnly"] is True  # the service not
    assert "initContainers" not in deployment(render_valid(), "capture")["spec"]["template"]["spec"]
    assert "model.source must be pvc or hostPath" in render_error(
        {"model": {"fillFromImage": True, "source": "image"}}
    )


# --- the stack plan ------------------------------------------------------------------------

PLAN_VALUES = {
    "readout": {"replicas": 3, "workers": 4, "engine": "onnx", "leaseSeconds": 5,
                "ackWaitSeconds": 8, "ports": {"metrics": 9191, "health": 50072}},
    "capture": {"replicas": 2, "ports": {"grpc": 50062, "metrics": 9292}, "compile": "inductor",
                "laneBuckets": "2,8", "batchWindowSeconds": 0.002},
    "gateway": {"ports": {"http": 8080, "grpc": 50052}, "requestTimeoutSeconds": 30},
    "serving": {"maxLanes": 16, "answerDepthMax": 512},
    "model": {"name": "org/model-v2.1", "mountPath": "/opt/m"},
    "nats": {"url": "nats://a:4222,nats://b:4222,nats://c:4222", "replicas": 3},
    "logLevel": "debug",
}  # fmt: skip


@pytest.mark.parametrize(
    "values",
    [{}, PLAN_VALUES, {**PLAN_VALUES, "placement": "pod"}],
    ids=["defaults", "changed", "pod"],
)
def test_the_chart_deploys_the_stack_plan_for_the_same_values(values):
    """The services the chart deploys, their ports and each one's config agree with the stack
    plan (stateblock/app/plan.py) for the same values, but for where each deployment puts
    its files and finds its peers; with placement pod, a readout process per capture pod."""
    plan, docs = plan_for(values), render_valid(values)
    services = plan.services()
    components = {name for d in of_kind(docs, "Deployment").values() for name in containers_of(d)}
    assert components == {s.component for s in services} == set(CONFIGS)  # NATS is external
    for component in ("capture", "readout"):
        processes = [s for s in services if s.component == component]
        assert deployment(docs, component)["spec"]["replicas"] == len(processes), component

    wiring = Wiring(plan.nats_url, Path("keys"), Path("readout-keys"), Path("token"))
    for component, read in CONFIGS.items():
        deployed = read.from_env(env_of(docs, component))
        planned = plan.config(plan.service(component), wiring)
        for f in dataclasses.fields(read):
            if f.name not in PLACED[component]:
                assert getattr(deployed, f.name) == getattr(planned, f.name), (component, f.name)
        # a shared pod's port names are unique in the pod: "readout-metrics"
        ports = {p["name"].removeprefix(f"{component}-"): p["containerPort"]
                 for p in container(docs, component)["ports"]}  # fmt: skip
        if component == "gateway":
            assert (ports["http"], ports["grpc"]) == (plan.ports.http, plan.ports.grpc)
            assert {int(deployed.capture_target.rsplit(":", 1)[1])} == set(plan.ports.capture)
        elif component == "capture":
            assert {(ports["grpc"], ports["metrics"])} == set(
                zip(plan.ports.capture, plan.ports.capture_metrics, strict=True)
            )
        else:
            assert {(ports["metrics"], ports["health"])} == set(
                zip(plan.ports.readout_metrics, plan.ports.readout_health, strict=True)
            )
