"""The gateway's configuration, read once from STATEBLOCK_* variables (declared in
stateblock/settings.py: defaults, bounds and help live there)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stateblock import runtime, settings
from stateblock.protocol.sampling import Limits

declared = settings.fields_for(settings.GATEWAY)


@dataclass(frozen=True)
class GatewayConfig:
    nats_url: str = declared(settings.NATS_URL)  # one URL, or a cluster's, comma-separated
    # copies of every stream and bucket on a JetStream cluster (1: the embedded server)
    nats_replicas: int = declared(settings.NATS_REPLICAS)
    capture_target: str = declared(settings.CAPTURE_TARGET)  # the Capture service's gRPC address
    # the internal token sent on every Capture call; None: none sent (a loopback capture)
    capture_token_file: Path | None = declared(settings.CAPTURE_TOKEN_FILE)
    host: str = declared(settings.GATEWAY_HOST)
    http_port: int = declared(settings.HTTP_PORT)  # 0 picks a free port
    grpc_port: int = declared(settings.GRPC_PORT)
    model_name: str = declared(settings.MODEL_NAME)
    base_dir: Path = declared(settings.BASE_DIR)  # the tokenizer, to decode answers
    decoder_dir: Path = declared(settings.DECODER_DIR)  # its manifest: the default max_tokens
    # every *.pub in here is a readout key whose commits and rejections are believed
    readout_trusted_keys_dir: Path = declared(settings.READOUT_TRUSTED_KEYS_DIR)
    request_timeout_s: float = declared(settings.REQUEST_TIMEOUT_S)
    # prompts x n, prompt length, answer envelope
    limits: Limits = settings.limits_field(settings.GATEWAY)
    stream_chunk_tokens: int = declared(settings.STREAM_CHUNK_TOKENS)
    # an HTTP request body over this is a 413, unread
    max_body_bytes: int = declared(settings.MAX_BODY_BYTES)
    # how long a retry with an Idempotency-Key finds its first
    idempotency_ttl_s: float = declared(settings.IDEMPOTENCY_TTL_S)
    # clients must send it (HTTP `Authorization: Bearer`, gRPC `authorization` metadata) on
    # the API (/v1/*, /tokenize, /detokenize, the Gateway service); None: no check
    api_key: str | None = declared(settings.API_KEY, repr=False)
    # TLS for both listeners (HTTP and gRPC) from PEM files; both or neither
    tls_cert_file: Path | None = declared(settings.TLS_CERT_FILE)
    tls_key_file: Path | None = declared(settings.TLS_KEY_FILE)
    grace_s: float = declared(settings.GRACE_S)
    ready_timeout_s: float = declared(settings.READY_TIMEOUT_S)  # readiness: a round trip's bound
    log_level: str = declared(settings.LOG_LEVEL)

    def __post_init__(self) -> None:
        runtime.model_name(self.model_name)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise runtime.ConfigError(
                "STATEBLOCK_TLS_CERT_FILE and STATEBLOCK_TLS_KEY_FILE go together"
            )
        for path in (self.tls_cert_file, self.tls_key_file):
            if path is not None and not Path(path).is_file():
                raise runtime.ConfigError(f"TLS file {path} does not exist")

    @property
    def tls(self) -> tuple[Path, Path] | None:
        """(certificate chain, private key) PEM files, when the listeners speak TLS."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return self.tls_cert_file, self.tls_key_file

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GatewayConfig:
        return settings.read_config(cls, environ)
