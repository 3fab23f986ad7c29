"""The Helm chart (deploy/helm/stateblock): rendered offline, every manifest schema-validated.

helm-python-sdk renders with Helm's own Go SDK, compiled into a shared library inside its
wheel: no helm binary, no cluster, no network. kubernetes-validate checks each manifest
against its bundled, strict (no unknown fields) schemas for the chart's minimum Kubernetes.
The env of every container is read back through the services' own `from_env`.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from capture_svc.config import CaptureConfig
from gateway.config import GatewayConfig
from readout_svc.config import ReadoutServiceConfig
from stateblock import settings
from stateblock.protocol import tokens
from stateblock.protocol.keys import TrustStore, generate_keypair, load_or_generate_signer
from tests.unit.deploy.chart import (
    CONFIGS,
    RELEASE,
    container,
    default_env,
    deployment,
    env_of,
    kinds,
    of_kind,
    render,
    render_valid,
    secrets_referenced,
    selects,
    value_at,
    values_with,
    volumes_by_mount,
)

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
    assert set(env) == default_env(component)
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
    one is given (a new pod warms up from it), else an emptyDir; eager: neither. The chart's
    capture runs on a GPU, so it compiles (`default`) unless told `off`."""
    assert CONFIGS["capture"].from_env(env_of(default_docs, "capture")).compile == "default"
    eager = render_valid({"capture": {"compile": "off"}})
    assert "STATEBLOCK_CAPTURE_COMPILE_CACHE" not in env_of(eager, "capture")
    assert "/var/cache/stateblock-compile" not in volumes_by_mount(eager, "capture")
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
