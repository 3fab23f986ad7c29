"""The gateway's configuration, read once from STATEBLOCK_* variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from stateblock import runtime
from stateblock.protocol.sampling import Limits
from stateblock.runtime import Env


@dataclass(frozen=True)
class GatewayConfig:
    nats_url: str = runtime.DEFAULT_NATS_URL  # one URL, or a cluster's, comma-separated
    # copies of every stream and bucket on a JetStream cluster (1: the embedded server)
    nats_replicas: int = 1
    capture_target: str = "127.0.0.1:50061"  # the Capture service's gRPC address
    host: str = "0.0.0.0"
    http_port: int = 8000  # 0 picks a free port
    grpc_port: int = 50051
    model_name: str = runtime.DEFAULT_MODEL_NAME
    base_dir: Path = runtime.REFERENCE_BASE  # the tokenizer, to decode answers
    decoder_dir: Path = runtime.REFERENCE_DECODER  # its manifest: the default max_tokens
    # every *.pub in here is a readout key whose commits and rejections are believed
    readout_trusted_keys_dir: Path = Path("readout-keys")
    request_timeout_s: float = 60.0
    limits: Limits = Limits()  # prompts x n, prompt length, answer envelope
    stream_chunk_tokens: int = 16
    max_body_bytes: int = 4 << 20  # an HTTP request body over this is a 413, unread
    idempotency_ttl_s: float = 600.0  # how long a retry with an Idempotency-Key finds its first
    # clients must send it (HTTP `Authorization: Bearer`, gRPC `authorization` metadata) on
    # the API (/v1/*, /tokenize, /detokenize, the Gateway service); None: no check
    api_key: str | None = field(default=None, repr=False)
    # TLS for both listeners (HTTP and gRPC) from PEM files; both or neither
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    grace_s: float = runtime.DEFAULT_GRACE_S
    ready_timeout_s: float = runtime.DEFAULT_READY_TIMEOUT_S  # readiness: a round trip's bound
    log_level: str = "info"

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
        e = Env(environ)
        d = cls()
        return cls(
            nats_url=e.str("NATS_URL", d.nats_url),
            nats_replicas=e.int("NATS_REPLICAS", d.nats_replicas, minimum=1),
            capture_target=e.str("CAPTURE_TARGET", d.capture_target),
            host=e.str("GATEWAY_HOST", d.host),
            http_port=e.int("HTTP_PORT", d.http_port, minimum=0),
            grpc_port=e.int("GRPC_PORT", d.grpc_port, minimum=0),
            model_name=e.str("MODEL_NAME", d.model_name),
            base_dir=e.path("BASE_DIR", d.base_dir),
            decoder_dir=e.path("DECODER_DIR", d.decoder_dir),
            readout_trusted_keys_dir=e.path("READOUT_TRUSTED_KEYS_DIR", d.readout_trusted_keys_dir),
            request_timeout_s=e.float("REQUEST_TIMEOUT_S", d.request_timeout_s),
            limits=runtime.limits_from_env(e),
            stream_chunk_tokens=e.int("STREAM_CHUNK_TOKENS", d.stream_chunk_tokens, minimum=1),
            max_body_bytes=e.int("MAX_BODY_BYTES", d.max_body_bytes, minimum=1024),
            idempotency_ttl_s=e.float("IDEMPOTENCY_TTL_S", d.idempotency_ttl_s),
            api_key=e.optional_str("API_KEY"),
            tls_cert_file=e.optional_path("TLS_CERT_FILE"),
            tls_key_file=e.optional_path("TLS_KEY_FILE"),
            grace_s=e.float("GRACE_S", d.grace_s),
            ready_timeout_s=e.float("READY_TIMEOUT_S", d.ready_timeout_s),
            log_level=e.str("LOG_LEVEL", d.log_level),
        )
