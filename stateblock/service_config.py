"""What the services' configs share, as base classes each service's config extends.

A setting several services read is one field here, declared once in stateblock/settings.py
and read once by `settings.read_config`: `ServiceConfig` holds what every service reads
(the bus, the model it serves, the request limits, shutdown and readiness bounds, logging),
`BlocksServiceConfig` what the two services on the blocks stream read alike (the capture and
the readout: both create that stream, so its storage and duplicate window agree).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from stateblock import runtime, settings
from stateblock.protocol.sampling import Limits

every = settings.fields_for(*settings.SERVICES)
on_blocks = settings.fields_for(settings.CAPTURE, settings.READOUT)


@dataclass(frozen=True)
class ServiceConfig:
    nats_url: str = every(settings.NATS_URL)  # one URL, or a cluster's, comma-separated
    # copies of every stream and bucket on a JetStream cluster (1: the embedded server)
    nats_replicas: int = every(settings.NATS_REPLICAS)
    model_name: str = every(settings.MODEL_NAME)  # what clients ask for; names its subjects
    # the base model (the gateway: its tokenizer, to decode answers)
    base_dir: Path = every(settings.BASE_DIR)
    # the decoder (the gateway: its manifest, for the default max_tokens)
    decoder_dir: Path = every(settings.DECODER_DIR)
    # prompts x n, prompt length, answer depth: what a request (and a signed block) may ask
    limits: Limits = settings.limits_field(*settings.SERVICES)
    grace_s: float = every(settings.GRACE_S)  # SIGTERM waits this long for work in flight
    ready_timeout_s: float = every(settings.READY_TIMEOUT_S)  # readiness: a round trip's bound
    log_level: str = every(settings.LOG_LEVEL)

    def __post_init__(self) -> None:
        runtime.model_name(self.model_name)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """Every field read from `environ` (os.environ by default); raises
        runtime.ConfigError naming the variable."""
        return settings.read_config(cls, environ)


@dataclass(frozen=True)
class BlocksServiceConfig(ServiceConfig):
    device: str = on_blocks(settings.DEVICE)  # where the model runs: cpu or cuda
    # JetStream's duplicate window of the blocks stream: a republished block id inside it is
    # dropped
    duplicate_window_s: float = on_blocks(settings.DUPLICATE_WINDOW_S)
    # the blocks work queue: "file" or "memory" (streams.py)
    blocks_storage: str = on_blocks(settings.BLOCKS_STORAGE)
    # where /metrics (and the readout's health check) listen: loopback unless told (the Helm
    # chart says 0.0.0.0)
    metrics_host: str = on_blocks(settings.METRICS_HOST)
    # how a block's rows travel: "bus" (its payload), "local" (a slot pool the capture and the
    # readout of one process share: `stateblock up`) or "host" (/dev/shm); both must agree
    data_plane: str = on_blocks(settings.DATA_PLANE)

    def __post_init__(self) -> None:
        super().__post_init__()
        runtime.blocks_storage(self.blocks_storage)
        runtime.data_plane(self.data_plane)
