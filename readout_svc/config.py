"""The readout service's configuration, read once from STATEBLOCK_* variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stateblock import runtime
from stateblock.protocol.sampling import Limits
from stateblock.runtime import Env


@dataclass(frozen=True)
class ReadoutServiceConfig:
    nats_url: str = runtime.DEFAULT_NATS_URL  # one URL, or a cluster's, comma-separated
    # copies of every stream and bucket on a JetStream cluster (1: the embedded server)
    nats_replicas: int = 1
    model_name: str = runtime.DEFAULT_MODEL_NAME
    base_dir: Path = runtime.REFERENCE_BASE
    decoder_dir: Path = runtime.REFERENCE_DECODER
    engine: str = "reference"
    # torch engine only: "high" runs the decoder's linears in TF32 through torch's
    # process-wide switch, safe in a readout process of its own (docs/BENCHMARKS.md)
    matmul_precision: str = "highest"
    readout_head: str = ""  # torch engine only: "fused" or "lm_head"; "": the engine's default
    # torch engine only: plain greedy cohorts on a bf16 copy of the decoder and head;
    # "float32": every cohort exact; "": the engine's default (bf16 on a GPU, audited:
    # docs/PARITY.md; exact on the CPU)
    greedy_dtype: str = ""
    trusted_keys_dir: Path = Path("keys")  # every *.pub in here is a trusted capture key
    # this service's own signing key for claims, commits and rejections; generated on first run
    signing_key_dir: Path = Path("readout-keys")
    # every readout key whose registry claims and outcomes stand (the gateway's set); an
    # entry no key here signed is a forger's and is claimed over. Default: signing_key_dir.
    readout_trusted_keys_dir: Path | None = None
    limits: Limits = Limits()  # what a signed block may ask this worker to read
    device: str = "cpu"
    workers: int = 2  # concurrent pull loops in this process
    worker_id: str = ""  # default: host-pid-based, set at start-up
    # A live worker renews both every lease_s / 3 (in_progress), so these bound only how long
    # a dead worker holds a block: well inside a request's deadline (60 s by default).
    lease_s: float = 10.0
    ack_wait_s: float = 15.0  # > lease: JetStream redelivers only after the claim could expire
    max_deliver: int = 8
    fetch_timeout_s: float = 0.5  # how long an idle worker waits per pull (and to notice stop)
    retry_delay_s: float = 1.0  # nak delay for a block another worker holds a live claim on
    duplicate_window_s: float = 120.0
    blocks_storage: str = "file"  # the blocks work queue: "file" or "memory" (streams.py)
    metrics_port: int | None = None
    # the standard gRPC health service, on this process's event loop: SERVING while NATS is
    # connected and the engine answers (the chart's probes); None: not served
    health_port: int | None = None
    # where /metrics (and the readout health check) listen: loopback unless told (the Helm
    # chart says 0.0.0.0)
    metrics_host: str = "127.0.0.1"
    grace_s: float = runtime.DEFAULT_GRACE_S
    ready_timeout_s: float = runtime.DEFAULT_READY_TIMEOUT_S  # readiness: a round trip's bound
    log_level: str = "info"

    def __post_init__(self) -> None:
        runtime.model_name(self.model_name)
        runtime.blocks_storage(self.blocks_storage)
        if self.matmul_precision not in ("highest", "high"):
            raise runtime.ConfigError("STATEBLOCK_MATMUL_PRECISION must be highest or high")
        if self.readout_head not in ("", "fused", "lm_head"):
            raise runtime.ConfigError("STATEBLOCK_READOUT_HEAD must be fused or lm_head")
        if self.greedy_dtype not in ("", "bfloat16", "float32"):
            raise runtime.ConfigError("STATEBLOCK_GREEDY_DTYPE must be bfloat16 or float32 (off)")
        if self.engine != "torch" and self.engine_options():
            raise runtime.ConfigError(
                "STATEBLOCK_MATMUL_PRECISION, STATEBLOCK_READOUT_HEAD and "
                "STATEBLOCK_GREEDY_DTYPE apply to "
                f"STATEBLOCK_ENGINE=torch only, not {self.engine!r}"
            )
        if self.workers < 1:
            raise runtime.ConfigError("STATEBLOCK_WORKERS must be >= 1")
        if self.ack_wait_s <= self.lease_s:
            raise runtime.ConfigError("STATEBLOCK_ACK_WAIT_S must exceed STATEBLOCK_LEASE_S")

    def engine_options(self) -> dict[str, str]:
        """The engine settings that differ from the engine's defaults."""
        options = {}
        if self.matmul_precision != "highest":
            options["matmul_precision"] = self.matmul_precision
        if self.readout_head:
            options["head"] = self.readout_head
        if self.greedy_dtype:
            options["greedy_dtype"] = self.greedy_dtype
        return options

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ReadoutServiceConfig:
        e = Env(environ)
        d = cls()
        metrics = e.int("READOUT_METRICS_PORT", -1)
        health = e.int("READOUT_HEALTH_PORT", -1)
        return cls(
            nats_url=e.str("NATS_URL", d.nats_url),
            nats_replicas=e.int("NATS_REPLICAS", d.nats_replicas, minimum=1),
            model_name=e.str("MODEL_NAME", d.model_name),
            base_dir=e.path("BASE_DIR", d.base_dir),
            decoder_dir=e.path("DECODER_DIR", d.decoder_dir),
            engine=e.str("ENGINE", d.engine),
            matmul_precision=e.str("MATMUL_PRECISION", d.matmul_precision),
            readout_head=e.str("READOUT_HEAD", d.readout_head),
            greedy_dtype=e.str("GREEDY_DTYPE", d.greedy_dtype),
            trusted_keys_dir=e.path("TRUSTED_KEYS_DIR", e.path("KEY_DIR", d.trusted_keys_dir)),
            signing_key_dir=e.path("READOUT_KEY_DIR", d.signing_key_dir),
            readout_trusted_keys_dir=e.optional_path("READOUT_TRUSTED_KEYS_DIR"),
            limits=runtime.limits_from_env(e),
            device=e.str("DEVICE", d.device),
            workers=e.int("WORKERS", d.workers, minimum=1),
            worker_id=e.str("WORKER_ID", d.worker_id),
            lease_s=e.float("LEASE_S", d.lease_s),
            ack_wait_s=e.float("ACK_WAIT_S", d.ack_wait_s),
            max_deliver=e.int("MAX_DELIVER", d.max_deliver, minimum=1),
            fetch_timeout_s=e.float("FETCH_TIMEOUT_S", d.fetch_timeout_s),
            retry_delay_s=e.float("RETRY_DELAY_S", d.retry_delay_s),
            duplicate_window_s=e.float("DUPLICATE_WINDOW_S", d.duplicate_window_s),
            blocks_storage=e.str("BLOCKS_STORAGE", d.blocks_storage),
            metrics_port=None if metrics < 0 else metrics,
            health_port=None if health < 0 else health,
            metrics_host=e.str("METRICS_HOST", d.metrics_host),
            grace_s=e.float("GRACE_S", d.grace_s),
            ready_timeout_s=e.float("READY_TIMEOUT_S", d.ready_timeout_s),
            log_level=e.str("LOG_LEVEL", d.log_level),
        )
