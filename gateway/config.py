"""The gateway's configuration: the fields every service reads (ServiceConfig) and its own,
read once from STATEBLOCK_* variables declared in stateblock/settings.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stateblock import runtime, settings
from stateblock.service_config import ServiceConfig

declared = settings.fields_for(settings.GATEWAY)


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    capture_target: str = declared(settings.CAPTURE_TARGET)  # the Capture service's gRPC address
    # the internal token sent on every Capture call; None: none sent (a loopback capture)
    capture_token_file: Path | None = declared(settings.CAPTURE_TOKEN_FILE)
    host: str = declared(settings.GATEWAY_HOST)  # both listeners bind it
    http_port: int = declared(settings.HTTP_PORT)  # 0 picks a free port
    grpc_port: int = declared(settings.GRPC_PORT)  # the Gateway service; 0: a free port
    # every *.pub in here is a readout key whose commits and rejections are believed
    readout_trusted_keys_dir: Path = declared(settings.READOUT_TRUSTED_KEYS_DIR)
    request_timeout_s: float = declared(settings.REQUEST_TIMEOUT_S)  # capture to outcome
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

    def __post_init__(self) -> None:
        super().__post_init__()
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
