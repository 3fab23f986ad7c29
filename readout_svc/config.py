"""The readout service's configuration, read once from STATEBLOCK_* variables (declared in
stateblock/settings.py: defaults, bounds and help live there)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stateblock import runtime, settings
from stateblock.protocol.sampling import Limits

declared = settings.fields_for(settings.READOUT)


@dataclass(frozen=True)
class ReadoutServiceConfig:
    nats_url: str = declared(settings.NATS_URL)  # one URL, or a cluster's, comma-separated
    # copies of every stream and bucket on a JetStream cluster (1: the embedded server)
    nats_replicas: int = declared(settings.NATS_REPLICAS)
    model_name: str = declared(settings.MODEL_NAME)
    base_dir: Path = declared(settings.BASE_DIR)
    decoder_dir: Path = declared(settings.DECODER_DIR)
    engine: str = declared(settings.ENGINE)
    # torch engine only: "high" runs the decoder's linears in TF32 through torch's
    # process-wide switch, safe in a readout process of its own (docs/BENCHMARKS.md)
    matmul_precision: str = declared(settings.MATMUL_PRECISION)
    # torch engine only: "fused" or "lm_head"; "": the engine's default
    readout_head: str = declared(settings.READOUT_HEAD)
    # torch engine only: plain greedy cohorts on a bf16 copy of the decoder and head;
    # "float32": every cohort exact; "": the engine's default (bf16 on a GPU, audited:
    # docs/PARITY.md; exact on the CPU)
    greedy_dtype: str = declared(settings.GREEDY_DTYPE)
    # every *.pub in here is a trusted capture key
    trusted_keys_dir: Path = declared(settings.TRUSTED_KEYS_DIR)
    # this service's own signing key for claims, commits and rejections; generated on first run
    signing_key_dir: Path = declared(settings.READOUT_KEY_DIR)
    # every readout key whose registry claims and outcomes stand (the gateway's set); an
    # entry no key here signed is a forger's and is claimed over. Default: signing_key_dir.
    readout_trusted_keys_dir: Path | None = declared(settings.READOUT_TRUSTED_KEYS_DIR)
    # what a signed block may ask this worker to read
    limits: Limits = settings.limits_field(settings.READOUT)
    device: str = declared(settings.DEVICE)
    workers: int = declared(settings.WORKERS)  # concurrent pull loops in this process
    # lanes of several blocks in one engine execution (readout_svc.cohorts); 1: block by block
    cohort_lanes: int = declared(settings.READOUT_COHORT_LANES)
    worker_id: str = declared(settings.WORKER_ID)  # default: host-pid-based, set at start-up
    # A live worker renews both every lease_s / 3 (in_progress), so these bound only how long
    # a dead worker holds a block: well inside a request's deadline (60 s by default).
    lease_s: float = declared(settings.LEASE_S)
    # > lease: JetStream redelivers only after the claim could expire
    ack_wait_s: float = declared(settings.ACK_WAIT_S)
    max_deliver: int = declared(settings.MAX_DELIVER)
    # how long an idle worker waits per pull (and to notice stop)
    fetch_timeout_s: float = declared(settings.FETCH_TIMEOUT_S)
    # nak delay for a block another worker holds a live claim on
    retry_delay_s: float = declared(settings.RETRY_DELAY_S)
    duplicate_window_s: float = declared(settings.DUPLICATE_WINDOW_S)
    # how the rows travel: "bus", or "local" (the capture's slot pool in this process, whose
    # placement's blocks these workers consume)
    data_plane: str = declared(settings.DATA_PLANE)
    # the blocks work queue: "file" or "memory" (streams.py)
    blocks_storage: str = declared(settings.BLOCKS_STORAGE)
    metrics_port: int | None = declared(settings.READOUT_METRICS_PORT)
    # the standard gRPC health service, on this process's event loop: SERVING while NATS is
    # connected and the engine answers (the chart's probes); None: not served
    health_port: int | None = declared(settings.READOUT_HEALTH_PORT)
    # where /metrics (and the readout health check) listen: loopback unless told (the Helm
    # chart says 0.0.0.0)
    metrics_host: str = declared(settings.METRICS_HOST)
    grace_s: float = declared(settings.GRACE_S)
    ready_timeout_s: float = declared(settings.READY_TIMEOUT_S)  # readiness: a round trip's bound
    log_level: str = declared(settings.LOG_LEVEL)

    def __post_init__(self) -> None:
        runtime.model_name(self.model_name)
        runtime.blocks_storage(self.blocks_storage)
        runtime.data_plane(self.data_plane)
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
        return settings.read_config(cls, environ)
