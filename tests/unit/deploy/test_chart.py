"""The Helm chart (deploy/helm/stateblock): rendered offline, every manifest schema-validated.

helm-python-sdk renders with Helm's own Go SDK, compiled into a shared library inside its
wheel: no helm binary, no cluster, no network. kubernetes-validate checks each manifest
against its bundled, strict (no unknown fields) schemas for the chart's minimum Kubernetes.
The env of every container is read back through the services' own `from_env`.
"""

from __future__ import annotations

import base64
import dataclasses
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from capture_svc.config import CaptureConfig
from gateway.config import GatewayConfig
from readout_svc.config import ReadoutServiceConfig
from stateblock import settings
from stateblock.app.plan import Wiring
from stateblock.nats_client import parse_servers
from stateblock.protocol import tokens
from stateblock.protocol.keys import TrustStore, generate_keypair, load_or_generate_signer
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
    value_at,
    values_with,
    volumes_by_mount,
)


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render_valid()


@pytest.fixture(scope="module")
def keypair(tmp_path_factory) -> tuple[str, str, str]:
    files = generate_keypair(tmp_path_factory.mktemp("keys"))
    return files.key_id, files.private_path.read_text(), files.public_path.read_text()


# --- default values ---------------------------------------------------------------------


def test_default_values_render_and_validate(default_docs):
    assert kinds(default_docs) == sorted(
        ["Deployment"] * 3
        + ["Service"] * 3
        + ["PodDisruptionBudget"] * 3
        + ["Pod"]  # helm test
        + ["Secret"]  # the capture token
        + ["Secret"] * 4  # a NATS user's password per component, the server's users
    )
    for doc in default_docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/name"] == "stateblock"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/component"] in {*CONFIGS, "test", "nats"}


def test_selectors_ports_and_probes_are_consistent(default_docs):
    deployments = of_kind(default_docs, "Deployment")
    pod_labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments.items()}
    for name, dep in deployments.items():
        assert selects(dep["spec"]["selector"]["matchLabels"], pod_labels[name])
        # One pod set per selector: no Deployment's selector picks up another's pods.
        assert [
            n for n in deployments if selects(dep["spec"]["selector"]["matchLabels"], pod_labels[n])
        ] == [name]

    for svc in of_kind(default_docs, "Service").values():
        (target,) = [n for n in deployments if selects(svc["spec"]["selector"], pod_labels[n])]
        (c,) = deployments[target]["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{svc['metadata']['name']}: {port}"
            assert port["port"] == ports[port["targetPort"]]

    for pdb in of_kind(default_docs, "PodDisruptionBudget").values():
        matched = [
            n for n in deployments if selects(pdb["spec"]["selector"]["matchLabels"], pod_labels[n])
        ]
        assert matched == [pdb["metadata"]["name"]]

    for component in CONFIGS:
        c = container(default_docs, component)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            spec = c[probe]
            handler = spec.get("httpGet") or spec.get("tcpSocket") or spec.get("grpc")
            assert handler["port"] in ports or handler["port"] in ports.values(), (component, probe)
    gateway = container(default_docs, "gateway")
    # started once the process serves; ready only once NATS and the capture answer, so a
    # capture still warming up keeps the gateway unready, not restarting
    assert gateway["startupProbe"]["grpc"] == {"port": 50051, "service": "liveness"}
    assert "service" not in gateway["readinessProbe"]["grpc"]
    assert gateway["readinessProbe"]["grpc"]["port"] == 50051


def test_pods_run_non_root_with_read_only_root(default_docs):
    for component in CONFIGS:
        pod = deployment(default_docs, component)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["enableServiceLinks"] is False  # else STATEBLOCK_GATEWAY_HOST & co. leak in
        assert pod["automountServiceAccountToken"] is False
        c = container(default_docs, component)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert volumes_by_mount(default_docs, component)["/tmp"]["emptyDir"]
        env = env_of(default_docs, component)
        assert float(env["STATEBLOCK_GRACE_S"]) < pod["terminationGracePeriodSeconds"]


# --- env: exactly what each service reads ------------------------------------------------


@pytest.mark.parametrize("component", sorted(CONFIGS))
def test_env_is_exactly_what_the_declarations_say_the_service_reads(default_docs, component):
    env = env_of(default_docs, component)
    assert set(env) == settings.chart_variables(component)
    # The service's own parser accepts the rendered values (types, ranges, cross-checks).
    config = CONFIGS[component].from_env(env)
    assert config.model_name == "stateblock-reference"
    assert config.nats_url == "nats://nats:4222"
    mounts = volumes_by_mount(default_docs, component)
    assert mounts["/models"]["readOnly"] is True
    assert mounts["/models"]["persistentVolumeClaim"]["claimName"] == "stateblock-models"
    assert str(config.base_dir) == "/models/base"
    assert str(config.decoder_dir) == "/models/decoder"


def test_a_compiled_capture_keeps_its_compile_cache_on_a_volume(default_docs):
    """Compiled: STATEBLOCK_CAPTURE_COMPILE_CACHE names a mounted directory, a claim's when
    one is given (a new pod warms up from it), else an emptyDir; eager: neither."""
    assert "STATEBLOCK_CAPTURE_COMPILE_CACHE" not in env_of(default_docs, "capture")
    assert "/var/cache/stateblock-compile" not in volumes_by_mount(default_docs, "capture")
    for cache, volume in (
        ({}, {"emptyDir": {"sizeLimit": "8Gi"}}),
        ({"claimName": "compile-cache"}, {"persistentVolumeClaim": {"claimName": "compile-cache"}}),
    ):
        docs = render_valid({"capture": {"compile": "reduce-overhead", "compileCache": cache}})
        env = env_of(docs, "capture")
        config = CONFIGS["capture"].from_env(env)
        assert str(config.compile_cache) == "/var/cache/stateblock-compile"
        mount = volumes_by_mount(docs, "capture")["/var/cache/stateblock-compile"]
        assert {k: v for k, v in mount.items() if k in volume} == volume
        assert not mount.get("readOnly")


def test_optional_settings_reach_exactly_their_readers():
    from tests.unit.deploy.chart import env_from_secrets

    docs = render_valid({
        "natsClient": {"credsSecret": "nats-user", "tlsSecret": "nats-ca", "tlsClientCert": True},
        "auth": {"apiKeySecret": {"name": "sb-api", "key": "token"}},
        "capture": {"compile": "inductor"},
    })  # fmt: skip
    for component in CONFIGS:
        names = set(env_of(docs, component)) | set(env_from_secrets(docs, component))
        assert names == settings.chart_variables(component, optional=True), component


CHART_NUMBERS = [
    s
    for s in settings.SETTINGS
    if s.chart not in ("", settings.COMPUTED, settings.OPTIONAL) and s.type in (int, float)
]


@pytest.mark.parametrize("setting", CHART_NUMBERS, ids=lambda s: s.name)
def test_a_chart_value_reaches_every_service_that_reads_it(setting):
    """serving.maxLanes: 16 must reach the readout too, or the capture signs blocks every
    worker refuses."""
    changed = value_at(setting.chart) + 1
    docs = render_valid(values_with(setting.chart, changed))
    readers = [c for c in CONFIGS if c in setting.readers]
    assert readers
    for component in readers:
        raw = env_of(docs, component)[setting.name]
        assert setting.read({setting.name: raw}, component) == changed, component


def test_every_chart_key_of_the_declarations_is_in_values():
    keyed = [
        s for s in settings.SETTINGS if s.chart not in ("", settings.COMPUTED, settings.OPTIONAL)
    ]
    assert len(keyed) > 10
    for s in keyed:
        assert value_at(s.chart) is not None, s.name


def test_env_wires_services_together(default_docs):
    gateway = GatewayConfig.from_env(env_of(default_docs, "gateway"))
    capture = CaptureConfig.from_env(env_of(default_docs, "capture"))
    readout = ReadoutServiceConfig.from_env(env_of(default_docs, "readout"))

    host, port = gateway.capture_target.rsplit(":", 1)
    capture_svc = of_kind(default_docs, "Service")[host]
    assert selects(
        capture_svc["spec"]["selector"],
        deployment(default_docs, "capture")["spec"]["template"]["metadata"]["labels"],
    )
    assert (
        int(port)
        == capture.port
        == next(p["port"] for p in capture_svc["spec"]["ports"] if p["name"] == "grpc")
    )

    ports = {p["name"]: p["containerPort"] for p in container(default_docs, "gateway")["ports"]}
    assert (gateway.http_port, gateway.grpc_port) == (ports["http"], ports["grpc"]) == (8000, 50051)
    for component, config in (("capture", capture), ("readout", readout)):
        ports = {p["name"]: p["containerPort"] for p in container(default_docs, component)["ports"]}
        assert config.metrics_port == ports["metrics"]
    assert gateway.limits == capture.limits == readout.limits
    assert capture.duplicate_window_s == readout.duplicate_window_s
    assert (capture.device, capture.dtype) == ("cuda", "bfloat16")
    assert (readout.engine, readout.device) == ("reference", "cpu")


def test_env_passthrough_and_choices():
    docs = render_valid(
        {
            "capture": {"env": {"STATEBLOCK_PUBLISH_TIMEOUT_S": 3}, "compile": "inductor"},
            "readout": {"engine": "onnx", "workers": 4, "env": {"STATEBLOCK_RETRY_DELAY_S": "0.5"}},
            "gateway": {"env": {"STATEBLOCK_STREAM_CHUNK_TOKENS": 32}},
            "model": {"name": "my-model"},
        }
    )
    capture = CaptureConfig.from_env(env_of(docs, "capture"))
    readout = ReadoutServiceConfig.from_env(env_of(docs, "readout"))
    gateway = GatewayConfig.from_env(env_of(docs, "gateway"))
    assert (capture.publish_timeout_s, capture.compile) == (3.0, "inductor")
    assert (readout.engine, readout.workers, readout.retry_delay_s) == ("onnx", 4, 0.5)
    assert gateway.stream_chunk_tokens == 32
    assert {capture.model_name, readout.model_name, gateway.model_name} == {"my-model"}


# --- keys ---------------------------------------------------------------------------------


def test_each_private_key_is_mounted_only_into_its_signer(default_docs):
    capture_env = env_of(default_docs, "capture")
    key_mount = volumes_by_mount(default_docs, "capture")[capture_env["STATEBLOCK_KEY_DIR"]]
    assert key_mount["readOnly"] is True
    assert key_mount["secret"]["secretName"] == "stateblock-signing-key"
    trusted = volumes_by_mount(default_docs, "readout")[
        env_of(default_docs, "readout")["STATEBLOCK_TRUSTED_KEYS_DIR"]
    ]
    assert trusted["secret"]["secretName"] == "stateblock-trusted-keys"
    token = f"{RELEASE}-stateblock-capture-token"
    assert secrets_referenced(default_docs, "capture") == {
        "stateblock-signing-key", token, nats_user("capture")
    }  # fmt: skip
    assert secrets_referenced(default_docs, "readout") == {
        "stateblock-trusted-keys",
        "stateblock-readout-signing-key",
        "stateblock-readout-trusted-keys",
        nats_user("readout"),
    }
    assert secrets_referenced(default_docs, "gateway") == {
        "stateblock-readout-trusted-keys",
        token,
        nats_user("gateway"),
    }
    # the readout signs outcomes with its key; the gateway believes the same key set
    readout_env, gateway_env = env_of(default_docs, "readout"), env_of(default_docs, "gateway")
    readout_mounts = volumes_by_mount(default_docs, "readout")
    own = readout_mounts[readout_env["STATEBLOCK_READOUT_KEY_DIR"]]
    assert own["secret"]["secretName"] == "stateblock-readout-signing-key"
    believed = volumes_by_mount(default_docs, "gateway")[
        gateway_env["STATEBLOCK_READOUT_TRUSTED_KEYS_DIR"]
    ]
    assert believed["secret"]["secretName"] == "stateblock-readout-trusted-keys"
    assert (
        readout_env["STATEBLOCK_READOUT_TRUSTED_KEYS_DIR"]
        == (gateway_env["STATEBLOCK_READOUT_TRUSTED_KEYS_DIR"])
    )


def nats_user(component: str) -> str:
    """The Secret of a component's NATS password."""
    return f"{RELEASE}-stateblock-nats-{component}"


def materialize(secret: dict, directory: Path) -> Path:
    """Write a Secret's data as the kubelet would mount it."""
    directory.mkdir()
    for name, data in secret["data"].items():
        (directory / name).write_bytes(base64.b64decode(data))
    return directory


def test_chart_created_key_secrets_load_in_the_services(keypair, tmp_path):
    key_id, private_pem, public_pem = keypair
    old = generate_keypair(tmp_path / "old")
    readout = generate_keypair(tmp_path / "readout")
    docs = render_valid(
        {
            "keys": {
                "create": True,
                "keyId": key_id,
                "privateKey": private_pem,
                "publicKey": public_pem,
                "extraTrustedPublicKeys": {old.key_id: old.public_path.read_text()},
            },
            "readoutKeys": {
                "create": True,
                "keyId": readout.key_id,
                "privateKey": readout.private_path.read_text(),
                "publicKey": readout.public_path.read_text(),
            },
        }
    )
    secrets = of_kind(docs, "Secret")
    signing = secrets[f"{RELEASE}-stateblock-signing-key"]
    trusted = secrets[f"{RELEASE}-stateblock-trusted-keys"]
    assert set(signing["data"]) == {f"{key_id}.key"}
    assert set(trusted["data"]) == {f"{key_id}.pub", f"{old.key_id}.pub"}
    assert not any(b"PRIVATE" in base64.b64decode(v) for v in trusted["data"].values())
    readout_signing = secrets[f"{RELEASE}-stateblock-readout-signing-key"]
    readout_trusted = secrets[f"{RELEASE}-stateblock-readout-trusted-keys"]
    assert set(readout_signing["data"]) == {f"{readout.key_id}.key"}
    token = secrets[f"{RELEASE}-stateblock-capture-token"]["metadata"]["name"]
    assert secrets_referenced(docs, "capture") == {
        signing["metadata"]["name"], token, nats_user("capture")
    }  # fmt: skip
    assert secrets_referenced(docs, "readout") == {
        trusted["metadata"]["name"],
        readout_signing["metadata"]["name"],
        readout_trusted["metadata"]["name"],
        nats_user("readout"),
    }
    assert secrets_referenced(docs, "gateway") == {
        readout_trusted["metadata"]["name"], token, nats_user("gateway")
    }  # fmt: skip
    # Pods roll when their keys change.
    for component, key in (
        ("capture", "checksum/signing-key"),
        ("readout", "checksum/trusted-keys"),
        ("readout", "checksum/signing-key"),
        ("gateway", "checksum/trusted-keys"),
    ):
        assert deployment(docs, component)["spec"]["template"]["metadata"]["annotations"][key]

    # What the services do with the mounted files.
    signer = load_or_generate_signer(materialize(signing, tmp_path / "signing"))
    assert signer.key_id == key_id
    assert set(TrustStore.from_dir(materialize(trusted, tmp_path / "trusted"))) == {
        key_id,
        old.key_id,
    }
    readout_signer = load_or_generate_signer(materialize(readout_signing, tmp_path / "rs"))
    believed = TrustStore.from_dir(materialize(readout_trusted, tmp_path / "rt"))
    assert readout_signer.key_id == readout.key_id and set(believed) == {readout.key_id}


def test_the_capture_token_reaches_exactly_the_gateway_and_the_capture(default_docs, tmp_path):
    """One generated Secret, mounted into the gateway (it presents the token) and the
    capture (it checks it), where STATEBLOCK_CAPTURE_TOKEN_FILE points; the file loads."""
    name = f"{RELEASE}-stateblock-capture-token"
    secret = of_kind(default_docs, "Secret")[name]
    paths = set()
    for component in ("gateway", "capture"):
        path = Path(env_of(default_docs, component)["STATEBLOCK_CAPTURE_TOKEN_FILE"])
        volume = volumes_by_mount(default_docs, component)[str(path.parent)]
        assert volume["secret"]["secretName"] == name and volume["readOnly"] is True
        paths.add(path)
    assert len(paths) == 1 and name not in secrets_referenced(default_docs, "readout")
    (path,) = paths
    assert tokens.read_token(materialize(secret, tmp_path / "token") / path.name)

    # an existing Secret: referenced under its own name and key, none rendered
    docs = render({"captureToken": {"existingSecret": "mine", "key": "t"}})
    assert not any("capture-token" in name for name in of_kind(docs, "Secret"))
    for component in ("gateway", "capture"):
        assert "mine" in secrets_referenced(docs, component)
        assert env_of(docs, component)["STATEBLOCK_CAPTURE_TOKEN_FILE"].endswith("/t")


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
