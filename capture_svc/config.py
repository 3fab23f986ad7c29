"""The capture service's configuration, read once from STATEBLOCK_* variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stateblock import runtime
from stateblock.protocol import envelope
from stateblock.protocol.sampling import Limits
from stateblock.runtime import Env


@dataclass(frozen=True)
class CaptureConfig:
    nats_url: str = runtime.DEFAULT_NATS_URL  # one URL, or a cluster's, comma-separated
    # copies of every stream and bucket on a JetStream cluster (1: the embedded server)
    nats_replicas: int = 1
    host: str = "0.0.0.0"
    port: int = 50061  # gRPC Capture; 0 picks a free port
    model_name: str = runtime.DEFAULT_MODEL_NAME
    base_dir: Path = runtime.REFERENCE_BASE
    decoder_dir: Path = runtime.REFERENCE_DECODER
    key_dir: Path = Path("keys")  # the signing key; generated here on first run
    device: str = "cpu"
    dtype: str = "float32"
    batch_window_s: float = 0.0  # continuous batching; >0 waits for company
    # torch.compile backend for the base forward ("off", "inductor", "aot_eager", ...) or an
    # inductor mode ("reduce-overhead": one CUDA graph per shape, the GPU's fast path). The
    # start-up warm-up runs every (lane bucket, width bucket) shape before the service is
    # SERVING, so no request compiles. Off by default: a compiled kernel may round
    # differently per shape, so batched rows are no longer guaranteed bit-identical to the
    # same request alone.
    compile: str = "off"
    # compiled only: a cohort's lanes are padded up to the next of these (max_lanes is
    # always one), so the shapes to warm up are these x the prompt-width buckets
    lane_buckets: tuple[int, ...] = (1, 2, 4, 8)
    limits: Limits = Limits()  # lanes per request and per cohort forward, prompt length, depth
    block_ttl_s: float = 120.0
    duplicate_window_s: float = 120.0
    blocks_storage: str = "file"  # the blocks work queue: "file" or "memory" (streams.py)
    # the hash the block's forward_state_digest is signed as: "blake3" or "sha256"
    forward_state_digest: str = envelope.DEFAULT_FORWARD_STATE_ALGORITHM
    # a publish is retried within this (a leader election takes seconds); well inside the
    # request deadline
    publish_timeout_s: float = 20.0
    metrics_port: int | None = None
    # where /metrics listens: loopback unless told (the Helm chart says 0.0.0.0)
    metrics_host: str = "127.0.0.1"
    grace_s: float = runtime.DEFAULT_GRACE_S
    ready_timeout_s: float = runtime.DEFAULT_READY_TIMEOUT_S  # readiness: a round trip's bound
    log_level: str = "info"

    def __post_init__(self) -> None:
        runtime.model_name(self.model_name)
        runtime.blocks_storage(self.blocks_storage)
        try:
            envelope.forward_state_algorithm(self.forward_state_digest)
        except ValueError as e:
            raise runtime.ConfigError(f"STATEBLOCK_FORWARD_STATE_DIGEST: {e}") from None
        if not self.compile:
            raise runtime.ConfigError("compile must be 'off' or a torch.compile backend name")
        if not self.lane_buckets or min(self.lane_buckets) < 1:
            raise runtime.ConfigError(
                f"STATEBLOCK_CAPTURE_LANE_BUCKETS={','.join(map(str, self.lane_buckets))!r} "
                "must be positive lane counts"
            )

    @property
    def cohort_lane_buckets(self) -> tuple[int, ...] | None:
        """The lane counts a compiled cohort is padded to: the configured buckets below
        max_lanes, and max_lanes. None when the forward is eager: any lane count runs as is."""
        if self.compile == "off":
            return None
        top = self.limits.max_lanes
        return tuple(sorted({b for b in self.lane_buckets if b < top} | {top}))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CaptureConfig:
        e = Env(environ)
        d = cls()
        metrics = e.int("CAPTURE_METRICS_PORT", -1)
        return cls(
            nats_url=e.str("NATS_URL", d.nats_url),
            nats_replicas=e.int("NATS_REPLICAS", d.nats_replicas, minimum=1),
            host=e.str("CAPTURE_HOST", d.host),
            port=e.int("CAPTURE_PORT", d.port, minimum=0),
            model_name=e.str("MODEL_NAME", d.model_name),
            base_dir=e.path("BASE_DIR", d.base_dir),
            decoder_dir=e.path("DECODER_DIR", d.decoder_dir),
            key_dir=e.path("KEY_DIR", d.key_dir),
            device=e.str("DEVICE", d.device),
            dtype=e.str("CAPTURE_DTYPE", d.dtype),
            batch_window_s=e.float("BATCH_WINDOW_S", d.batch_window_s, zero_ok=True),
            compile=e.str("CAPTURE_COMPILE", d.compile),
            lane_buckets=_lane_buckets(e.str("CAPTURE_LANE_BUCKETS", ""), d.lane_buckets),
            limits=runtime.limits_from_env(e),
            block_ttl_s=e.float("BLOCK_TTL_S", d.block_ttl_s),
            duplicate_window_s=e.float("DUPLICATE_WINDOW_S", d.duplicate_window_s),
            blocks_storage=e.str("BLOCKS_STORAGE", d.blocks_storage),
            forward_state_digest=e.str("FORWARD_STATE_DIGEST", d.forward_state_digest),
            publish_timeout_s=e.float("PUBLISH_TIMEOUT_S", d.publish_timeout_s),
            metrics_port=None if metrics < 0 else metrics,
            metrics_host=e.str("METRICS_HOST", d.metrics_host),
            grace_s=e.float("GRACE_S", d.grace_s),
            ready_timeout_s=e.float("READY_TIMEOUT_S", d.ready_timeout_s),
            log_level=e.str("LOG_LEVEL", d.log_level),
        )


def _lane_buckets(raw: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """STATEBLOCK_CAPTURE_LANE_BUCKETS: lane counts, comma-separated ("1,2,4,8")."""
    if not raw:
        return default
    try:
        buckets = tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise runtime.ConfigError(
            f"STATEBLOCK_CAPTURE_LANE_BUCKETS={raw!r} must be lane counts, comma-separated"
        ) from None
    return buckets
