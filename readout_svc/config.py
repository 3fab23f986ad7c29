"""The readout service's configuration: the fields it shares with the capture
(BlocksServiceConfig) and its own, read once from STATEBLOCK_* variables declared in
stateblock/settings.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stateblock import runtime, settings
from stateblock.service_config import BlocksServiceConfig

declared = settings.fields_for(settings.READOUT)
DEFAULT_WORKERS = 2  # pull loops for an engine that reads every block alone


@dataclass(frozen=True)
class ReadoutServiceConfig(BlocksServiceConfig):
    engine: str = declared(settings.ENGINE)  # reference, onnx or torch; unknown: no start
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
    # concurrent pull loops in this process; None: `pull_loops` chooses by the engine
    workers: int | None = declared(settings.WORKERS)
    # lanes of several blocks in one engine execution (readout_svc.cohorts); 1: block by block
    cohort_lanes: int = declared(settings.READOUT_COHORT_LANES)
    overlap_lanes: int | None = declared(settings.READOUT_OVERLAP_LANES)  # None: cohort_lanes
    worker_id: str = declared(settings.WORKER_ID)  # default: host-pid-based, set at start-up
    # A live worker renews both every lease_s / 3 (in_progress), so these bound only how long
    # a dead worker holds a block: well inside a request's deadline (60 s by default).
    lease_s: float = declared(settings.LEASE_S)
    # > lease: JetStream redelivers only after the claim could expire
    ack_wait_s: float = declared(settings.ACK_WAIT_S)
    max_deliver: int = declared(settings.MAX_DELIVER)  # then a max_deliveries rejection
    # how long an idle worker waits per pull (and to notice stop)
    fetch_timeout_s: float = declared(settings.FETCH_TIMEOUT_S)
    # nak delay for a block another worker holds a live claim on
    retry_delay_s: float = declared(settings.RETRY_DELAY_S)
    metrics_port: int | None = declared(settings.READOUT_METRICS_PORT)  # None: no /metrics
    # the standard gRPC health service, on this process's event loop: SERVING while NATS is
    # connected and the engine answers (the chart's probes); None: not served
    health_port: int | None = declared(settings.READOUT_HEALTH_PORT)

    def __post_init__(self) -> None:
        super().__post_init__()
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
        if self.workers is not None and self.workers < 1:
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

    def engine_kwargs(self) -> dict[str, object]:
        """What the engine is created with: the settings above and, for the torch engine,
        the request limits its warm-up records every graph up to (no request records one)."""
        kwargs: dict[str, object] = dict(self.engine_options())
        if self.engine == "torch":
            kwargs["warm_up_to"] = (self.limits.prompt_len_max, self.limits.answer_depth_max)
        return kwargs

    def combines(self, engine: object) -> bool:
        """Whether this process reads several blocks in one execution of `engine` (one that
        says which blocks read the same together as alone: its `cohort_key`)."""
        return self.cohort_lanes > 1 and hasattr(engine, "cohort_key")

    def pull_loops(self, engine: object) -> int:
        """The pull loops to run: STATEBLOCK_WORKERS, or by default enough blocks in hand to
        fill the two executions a combining engine runs at once (a block of one lane each),
        else two."""
        if self.workers is not None:
            return self.workers
        return 2 * self.cohort_lanes if self.combines(engine) else DEFAULT_WORKERS
