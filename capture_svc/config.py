"""The capture service's configuration: the fields it shares with the readout
(BlocksServiceConfig) and its own, read once from STATEBLOCK_* variables declared in
stateblock/settings.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stateblock import runtime, settings
from stateblock.protocol import envelope, tokens
from stateblock.service_config import BlocksServiceConfig

declared = settings.fields_for(settings.CAPTURE)


# By default a compiled forward never runs one lane: dynamo compiles a batch of one as a
# graph of its own (it specializes sizes of 1), whose kernels may round otherwise than the
# symbolic-lanes graph every larger cohort runs, so a request alone would get other rows than
# in company. A lone lane runs with a dummy lane beside it, through the graph its company
# would use (STATEBLOCK_CAPTURE_MIN_LANES=1 compiles the lane count unbacked instead).
MIN_COMPILED_LANES = settings.CAPTURE_MIN_LANES.default
# inductor's modes whose compiled forward replays CUDA graphs (a graph is its recording
# thread's, so such a forward runs on one thread)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def default_compile(device: str) -> str:
    """The base forward's compile where none is set: inductor's `default` on a GPU (the
    fastest under load; docs/BENCHMARKS.md), eager on the CPU, where a compile's warm-up
    costs more than its kernels save."""
    return "default" if device.startswith("cuda") else "off"


@dataclass(frozen=True)
class CohortLimits:
    """What one base forward carries at most: lanes, and padded tokens (lanes x the bucket
    width). A forward goes over `tokens` only when a single lane does; a request over it is
    captured in parts (capture_svc.batcher)."""

    lanes: int
    tokens: int
    part_tokens: int | None = None  # one part's bound; None: `tokens`
    part_chunk: int | None = None  # a lane longer: a part of its own, run a chunk a turn

    def lanes_at(self, width: int) -> int:
        """The most lanes a forward of this bucket width carries: one at least (a lane over
        the token bound runs alone)."""
        return self._lanes_within(self.tokens, width)

    def part_lanes_at(self, width: int) -> int:
        """The most lanes one part of a request over the token bound carries at this width:
        one at least; one when a lane that wide runs in chunks."""
        if self.chunked(width):
            return 1
        return self._lanes_within(
            self.tokens if self.part_tokens is None else self.part_tokens, width
        )

    def chunked(self, length: int) -> bool:
        """Whether a lane this long is captured in chunks (its request then goes in parts,
        whatever its size: a prompt's rows never depend on its company)."""
        return self.part_chunk is not None and length > self.part_chunk

    def _lanes_within(self, tokens: int, width: int) -> int:
        return min(self.lanes, max(1, tokens // width))


@dataclass(frozen=True)
class CaptureConfig(BlocksServiceConfig):
    # None: 0.0.0.0 with a token, else loopback only (bind_host)
    host: str | None = declared(settings.CAPTURE_HOST)
    port: int = declared(settings.CAPTURE_PORT)  # gRPC Capture; 0 picks a free port
    # callers present the token in here (Bearer metadata); None: no check, loopback only
    token_file: Path | None = declared(settings.CAPTURE_TOKEN_FILE)
    key_dir: Path = declared(settings.KEY_DIR)  # the signing key; generated here on first run
    dtype: str = declared(settings.CAPTURE_DTYPE)
    batch_window_s: float = declared(settings.BATCH_WINDOW_S)  # >0 waits for company
    # torch.compile backend for the base forward ("off", "inductor", "aot_eager", ...) or an
    # inductor mode ("default", "reduce-overhead": one CUDA graph per shape); unset, "default"
    # on a CUDA device and "off" on the CPU. The start-up warm-up runs every (lane bucket,
    # width bucket) shape before the service is SERVING, so no request compiles.
    compile: str = declared(settings.CAPTURE_COMPILE)
    # compiled only: inductor's and Triton's caches, kept where a restart finds them
    compile_cache: Path | None = declared(settings.CAPTURE_COMPILE_CACHE)
    # one forward's lanes and padded tokens (lanes x bucket width), from as many requests as
    # fit: continuous batching sized by tokens, not only lanes
    cohort_lanes: int = declared(settings.CAPTURE_COHORT_LANES)
    cohort_tokens: int = declared(settings.CAPTURE_COHORT_TOKENS)
    part_tokens: int | None = declared(settings.CAPTURE_PART_TOKENS)  # None: cohort_tokens
    part_sms: int | None = declared(settings.CAPTURE_PART_SMS)  # None: every SM
    # a part's lane longer than this runs a chunk of it a turn; None: a lane a forward
    part_chunk_tokens: int | None = declared(settings.CAPTURE_PART_CHUNK_TOKENS)
    # a part waits this long at most while cohort forwards run or wait; 0: it does not
    part_yield_s: float = declared(settings.CAPTURE_PART_YIELD_S)
    # cohort forwards at once; None: 2 on a GPU, 1 on the CPU (forwards_in_flight)
    forwards: int | None = declared(settings.CAPTURE_FORWARDS)
    # compiled only: the shapes to warm up are these x the prompt-width buckets (the cohort's
    # lane limit is always one); a forward replaying CUDA graphs pads a cohort up to them
    lane_buckets: tuple[int, ...] = declared(settings.CAPTURE_LANE_BUCKETS)
    min_lanes: int = declared(settings.CAPTURE_MIN_LANES)  # compiled only: the fewest lanes
    rope: str = declared(settings.CAPTURE_ROPE)  # compiled only: "fused" or "table"
    block_ttl_s: float = declared(settings.BLOCK_TTL_S)
    # the hash the block's forward_state_digest is signed as: "blake3" or "sha256"
    forward_state_digest: str = declared(settings.FORWARD_STATE_DIGEST)
    # `local` / `host` data planes: the slots (regions) held at most; a full pool waits
    # publish_timeout_s
    data_plane_slots: int = declared(settings.DATA_PLANE_SLOTS)
    data_plane_arena_mb: int = declared(settings.DATA_PLANE_ARENA_MB)  # `ipc`: its arena
    # a publish is retried within this (a leader election takes seconds); well inside the
    # request deadline
    publish_timeout_s: float = declared(settings.PUBLISH_TIMEOUT_S)
    # gateways reconnect (and re-resolve a headless Service) this often: scaled-out replicas
    # get their share of the traffic
    max_connection_age_s: float = declared(settings.CAPTURE_MAX_CONNECTION_AGE_S)
    metrics_port: int | None = declared(settings.CAPTURE_METRICS_PORT)

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            envelope.forward_state_algorithm(self.forward_state_digest)
        except ValueError as e:
            raise runtime.ConfigError(f"STATEBLOCK_FORWARD_STATE_DIGEST: {e}") from None
        if self.token_file is None and self.host and not tokens.is_loopback(self.host):
            raise runtime.ConfigError(
                f"STATEBLOCK_CAPTURE_HOST={self.host} without STATEBLOCK_CAPTURE_TOKEN_FILE: "
                "anyone who reaches it could run forwards and get signed blocks; give a "
                "token file or bind a loopback address"
            )
        if self.compile is None:  # frozen: the device's default, resolved once here
            object.__setattr__(self, "compile", default_compile(self.device))
        if not self.compile:
            raise runtime.ConfigError("compile must be 'off' or a torch.compile backend name")
        if self.rope not in settings.CAPTURE_ROPE_MODES:
            modes = ", ".join(settings.CAPTURE_ROPE_MODES)
            raise runtime.ConfigError(
                f"STATEBLOCK_CAPTURE_ROPE={self.rope!r} must be one of {modes}"
            )
        if not self.lane_buckets or min(self.lane_buckets) < 1:
            raise runtime.ConfigError(
                f"STATEBLOCK_CAPTURE_LANE_BUCKETS={','.join(map(str, self.lane_buckets))!r} "
                "must be positive lane counts"
            )

    @property
    def bind_host(self) -> str:
        """The address to bind: the one set, else every interface when callers must present
        a token and loopback when they need not."""
        if self.host:
            return self.host
        return "0.0.0.0" if self.token_file is not None else "127.0.0.1"

    @property
    def cohort(self) -> CohortLimits:
        """One forward's bounds; the lane bound never below a request's (max_lanes)."""
        lanes = max(self.cohort_lanes, self.limits.max_lanes)
        return CohortLimits(lanes, self.cohort_tokens, self.part_tokens, self.part_chunk_tokens)

    @property
    def replays_graphs(self) -> bool:
        """The compiled forward replays CUDA graphs, which belong to the thread that recorded
        them: one forward thread."""
        return self.compile in CUDA_GRAPH_MODES

    @property
    def forwards_in_flight(self) -> int:
        """Cohort forwards at once: the setting's, else two on a GPU (it runs one cohort while
        the last one's rows go out) and one on the CPU (one forward uses every core); one
        when the forward replays CUDA graphs."""
        if self.replays_graphs:
            return 1
        if self.forwards is not None:
            return self.forwards
        return 2 if self.device.startswith("cuda") else 1

    @property
    def size_oblivious(self) -> bool:
        """The compiled forward runs lone lanes, so dynamo must not specialize a lane count
        of one (compile_backbone's size_oblivious)."""
        return self.compile != "off" and self.min_lanes == 1

    @property
    def warm_width_max(self) -> int:
        """The longest lane a compiled forward runs, whose width bucket the warm-up reaches:
        the prompt limit, or the chunk bound where a longer lane runs in chunks (eager)."""
        limit = self.limits.prompt_len_max
        return limit if self.part_chunk_tokens is None else min(limit, self.part_chunk_tokens)

    @property
    def warm_lane_buckets(self) -> tuple[int, ...] | None:
        """The lane counts the warm-up runs each width bucket at, compiled: the configured
        buckets below the cohort's lane limit, that limit, and min_lanes (the fewest a
        forward runs: where dynamo still makes one lane a graph of its own, the warm-up
        compiles it), none under min_lanes. None when the forward is eager."""
        if self.compile == "off":
            return None
        top = self.cohort.lanes
        buckets = {b for b in self.lane_buckets if b < top} | {top, self.min_lanes}
        return tuple(sorted({max(b, self.min_lanes) for b in buckets}))

    @property
    def cohort_lane_buckets(self) -> tuple[int, ...] | None:
        """The lane counts a cohort is padded to with dummy lanes: the warm-up's, where the
        forward replays CUDA graphs (one graph per shape). None otherwise: the symbolic
        graph serves any lane count, so a cohort runs at its own count (at least
        `cohort_min_lanes`) and pays for no dummy lanes."""
        return self.warm_lane_buckets if self.replays_graphs else None

    @property
    def cohort_min_lanes(self) -> int:
        """The fewest lanes a forward runs: min_lanes compiled, one eager."""
        return 1 if self.compile == "off" else self.min_lanes
