"""Every STATEBLOCK_* setting, declared once: name, type, default, bounds, help, who reads it.

Everything else is derived from these declarations: each service's frozen config
(`<Service>Config.from_env` is `read_config`, its fields name the setting they hold), the
NATS connection's files (`stateblock.nats_client.NatsOptions.of`), `stateblock up`'s flags
and `stateblock config` (`stateblock.app.settings`), the README's configuration table
(`markdown_table`) and what the Helm chart must set on each component (`chart_variables`);
tests compare the README and the rendered chart with them. Adding a setting: declare it
here, give the configs of its readers a field `declared(NEW)`, and regenerate the README
table (`stateblock config --markdown`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from stateblock import runtime
from stateblock.protocol import envelope
from stateblock.protocol.sampling import Limits
from stateblock.runtime import Env

GATEWAY, CAPTURE, READOUT, UP, ASK = "gateway", "capture", "readout", "up", "ask"
SERVICES = (GATEWAY, CAPTURE, READOUT)  # the three processes the chart deploys
ALL = (*SERVICES, UP)
READER_NAMES = {UP: "`stateblock up`", ASK: "`stateblock ask`"}  # as the docs name them

# Setting.chart: a values.yaml key the chart copies into every reader's environment, or
COMPUTED = "(computed)"  # the chart sets it on every reader from wiring it computes
OPTIONAL = "(optional)"  # the chart sets it only when its values ask (a Secret, a file)
# "" (the default): the chart leaves it to `<component>.env`

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Setting:
    name: str  # the variable: STATEBLOCK_<NAME>
    type: type  # str, int, float, Path, or tuple (of ints, comma-separated)
    default: Any  # None (int, Path, str): unset, a value of its own meaning (`unset`)
    help: str
    readers: tuple[str, ...]  # GATEWAY, CAPTURE, READOUT, UP, ASK
    minimum: int | None = None  # ints
    zero_ok: bool = False  # floats are > 0, or >= 0 with zero_ok
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # a reader's own
    fallback: Setting | None = None  # read when this one is unset
    chart: str = ""  # a values.yaml key, COMPUTED, OPTIONAL or ""
    unset: str = "none"  # what a None or "" default means, for the docs

    @property
    def key(self) -> str:
        return self.name.removeprefix("STATEBLOCK_")

    def default_for(self, reader: str | None) -> Any:
        return self.defaults.get(reader, self.default) if reader else self.default

    def read(self, environ: Mapping[str, str] | None = None, reader: str | None = None) -> Any:
        """The value under `environ` (os.environ by default) as `reader` reads it; raises
        runtime.ConfigError naming the variable."""
        env = Env(environ)
        default = self.default_for(reader)
        if self.fallback is not None:
            default = self.fallback._value(env, default)
        return self._value(env, default)

    def _value(self, env: Env, default: Any) -> Any:
        if self.type is int:
            if default is None:  # unset, or negative where no minimum says otherwise: none
                if env.optional_str(self.key) is None:
                    return None
                value = env.int(self.key, -1, minimum=self.minimum)
                return None if value < 0 else value
            return env.int(self.key, default, minimum=self.minimum)
        if self.type is float:
            return env.float(self.key, default, zero_ok=self.zero_ok)
        if self.type is Path:
            return env.optional_path(self.key) if default is None else env.path(self.key, default)
        if self.type is tuple:
            return _int_tuple(self.name, env.str(self.key, ""), default, self.minimum)
        return env.optional_str(self.key) if default is None else env.str(self.key, default)

    def field(self, *readers: str, **kw: Any) -> Any:
        """A dataclass field holding this setting in a config that `readers` share (one
        reader's own, or a base class of several readers' configs, which read it alike)."""
        for reader in readers:
            if reader not in self.readers:
                raise ValueError(f"{self.name} is not declared as read by {reader}")
        if len(readers) > 1 and set(readers) & set(self.defaults):
            raise ValueError(f"{self.name} has a default of its own for one of {readers}")
        reader = readers[0] if len(readers) == 1 else None
        meta = {"setting": self, "reader": reader}
        return dataclasses.field(default=self.default_for(reader), metadata=meta, **kw)


def _int_tuple(
    name: str, raw: str, default: tuple[int, ...], minimum: int | None
) -> tuple[int, ...]:
    """A comma-separated list of integers ("1,2,4,8"); empty: the default."""
    if not raw:
        return default
    try:
        values = tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise runtime.ConfigError(f"{name}={raw!r} must be integers, comma-separated") from None
    if minimum is not None and any(v < minimum for v in values):
        raise runtime.ConfigError(f"{name}={raw!r}: every value must be at least {minimum}")
    return values


def _setting(name: str, type_: type, default: Any, help_: str, readers, **kw: Any) -> Setting:
    s = Setting(f"STATEBLOCK_{name}", type_, default, help_, tuple(readers), **kw)
    SETTINGS.append(s)
    return s


SETTINGS: list[Setting] = []  # in declaration order: the README table's order

# --- every service -------------------------------------------------------------------------
NATS_URL = _setting(
    "NATS_URL", str, runtime.DEFAULT_NATS_URL,
    "one URL or a cluster's, comma-separated; reconnects forever once connected",
    ALL, defaults={UP: None}, unset="starts its own nats-server", chart=COMPUTED,
)  # fmt: skip
NATS_REPLICAS = _setting(
    "NATS_REPLICAS", int, 1, "copies of every stream and bucket on a JetStream cluster",
    ALL, minimum=1, chart=COMPUTED,
)  # fmt: skip
NATS_CREDS = _setting(
    "NATS_CREDS", Path, None, "a NATS credentials file (JWT and NKey seed)", ALL,
    chart=OPTIONAL,
)  # fmt: skip
NATS_USER = _setting(
    "NATS_USER", str, None,
    "the NATS user to connect as, with STATEBLOCK_NATS_PASSWORD_FILE; its replies come on "
    "`_INBOX_<user>.>`. `stateblock up` and the chart give each component its own user, "
    "allowed only the subjects that component uses (docs/RELIABILITY.md)", ALL,
    chart=COMPUTED,
)  # fmt: skip
NATS_PASSWORD_FILE = _setting(
    "NATS_PASSWORD_FILE", Path, None, "a file holding STATEBLOCK_NATS_USER's password", ALL,
    chart=COMPUTED,
)  # fmt: skip
NATS_TLS_CA = _setting(
    "NATS_TLS_CA", Path, None, "the CA the NATS servers' TLS certificates are checked against",
    ALL, chart=OPTIONAL,
)  # fmt: skip
NATS_TLS_CERT = _setting(
    "NATS_TLS_CERT", Path, None, "a NATS client certificate, for mutual TLS", ALL,
    chart=OPTIONAL,
)  # fmt: skip
NATS_TLS_KEY = _setting(
    "NATS_TLS_KEY", Path, None, "that client certificate's private key", ALL, chart=OPTIONAL,
)  # fmt: skip
EVENT_LOOP = _setting(
    "EVENT_LOOP", str, "auto", "`uvloop` or `asyncio`; `auto`: uvloop where installed", ALL,
)  # fmt: skip
MODEL_NAME = _setting(
    "MODEL_NAME", str, runtime.DEFAULT_MODEL_NAME,
    "the model name clients ask for (any Hugging Face-style name)", ALL, chart="model.name",
)  # fmt: skip
BASE_DIR = _setting(
    "BASE_DIR", Path, runtime.REFERENCE_BASE,
    "the base model directory (the gateway: its tokenizer)", ALL, chart=COMPUTED,
)  # fmt: skip
DECODER_DIR = _setting(
    "DECODER_DIR", Path, runtime.REFERENCE_DECODER,
    "the readout decoder directory (the gateway: its manifest's default `max_tokens`)", ALL,
    chart=COMPUTED,
)  # fmt: skip
LOG_LEVEL = _setting(
    "LOG_LEVEL", str, "info",
    "`debug`, `info`, `warning` or `error` (JSON lines, the request id bound)", ALL,
    defaults={UP: "warning"}, chart="logLevel",
)  # fmt: skip
READY_TIMEOUT_S = _setting(
    "READY_TIMEOUT_S", float, runtime.DEFAULT_READY_TIMEOUT_S,
    "readiness (HTTP `/health`, gRPC health `\"\"` and the service's name; the readout's health "
    "port) fails when NATS has not answered a round trip (a PING) in this long, or for the "
    "gateway the capture's health check; each is probed every half of it. Readout workers "
    "are not asked: blocks wait in the work queue for them", SERVICES,
)  # fmt: skip
GRACE_S = _setting(
    "GRACE_S", float, runtime.DEFAULT_GRACE_S,
    "how long SIGTERM waits for in-flight work before the servers stop", SERVICES,
    chart="graceSeconds",
)  # fmt: skip
MAX_LANES = _setting(
    "MAX_LANES", int, Limits.max_lanes,
    "K_max: prompts x n per request, lanes per cohort forward; the same limits everywhere "
    "(a readout worker refuses a signed block over its own)", SERVICES, minimum=1,
    chart="serving.maxLanes",
)  # fmt: skip
PROMPT_LEN_MAX = _setting(
    "PROMPT_LEN_MAX", int, Limits.prompt_len_max, "tokens per prompt", SERVICES, minimum=1,
    chart="serving.promptLenMax",
)  # fmt: skip
ANSWER_DEPTH_MAX = _setting(
    "ANSWER_DEPTH_MAX", int, Limits.answer_depth_max,
    "the answer envelope: `max_tokens` per lane", SERVICES, minimum=1,
    chart="serving.answerDepthMax",
)  # fmt: skip

# --- several services ----------------------------------------------------------------------
DEVICE = _setting(
    "DEVICE", str, "cpu",
    "`cpu` or `cuda`; `stateblock up`: `auto`, a CUDA device where there is one (the base "
    "model then in `bfloat16` unless STATEBLOCK_CAPTURE_DTYPE says otherwise)",
    (CAPTURE, READOUT, UP), defaults={UP: "auto"}, chart=COMPUTED,
)  # fmt: skip
METRICS_HOST = _setting(
    "METRICS_HOST", str, "127.0.0.1",
    "where `/metrics` (and the readout's health check) listen", (CAPTURE, READOUT),
    chart=COMPUTED,
)  # fmt: skip
DUPLICATE_WINDOW_S = _setting(
    "DUPLICATE_WINDOW_S", float, 120.0,
    "JetStream's duplicate window of the blocks stream (a republished block id is dropped "
    "inside it)", (CAPTURE, READOUT), chart="serving.duplicateWindowSeconds",
)  # fmt: skip
BLOCKS_STORAGE = _setting(
    "BLOCKS_STORAGE", str, "file",
    "JetStream storage of the blocks work queue, `file` or `memory` (about 2x faster "
    "publishes of large blocks; in-flight blocks do not survive a nats-server restart). Both "
    "services must agree; an existing stream of the other kind is a start-up error",
    (CAPTURE, READOUT),
)  # fmt: skip
READOUT_TRUSTED_KEYS_DIR = _setting(
    "READOUT_TRUSTED_KEYS_DIR", Path, Path("readout-keys"),
    "readout keys (`*.pub`) whose signed claims and outcomes stand: the gateway serves no "
    "others; a worker claims over an entry none of them signed", (GATEWAY, READOUT),
    defaults={READOUT: None}, unset="`STATEBLOCK_READOUT_KEY_DIR`", chart=COMPUTED,
)  # fmt: skip
WORKERS = _setting(
    "WORKERS", int, None,
    "readout pull loops in the process: the blocks it holds at once, which an engine that "
    "combines blocks (`torch`) needs to fill its executions", (READOUT, UP), minimum=1,
    chart="readout.workers",
    unset="twice `STATEBLOCK_READOUT_COHORT_LANES` for an engine that combines blocks, else 2",
)  # fmt: skip
READOUT_COHORT_LANES = _setting(
    "READOUT_COHORT_LANES", int, Limits.max_lanes,
    "lanes from several blocks the process reads in one engine execution, two executions at "
    "a time (only blocks the engine reads the same together as alone); 1: each block alone, "
    "`STATEBLOCK_WORKERS` executions at once. Blocks combine only when more are in hand than "
    "run: the workers' default is twice this for such an engine", (READOUT,), minimum=1,
)  # fmt: skip
READOUT_OVERLAP_LANES = _setting(
    "READOUT_OVERLAP_LANES", int, None,
    "lanes a cohort needs to start while another cohort's execution runs (an engine that "
    "combines blocks): it waits for more blocks or for that execution's end. An execution "
    "at a depth runs a fixed number of lanes however many came, so a full one costs each "
    "block least device time; 1 starts every cohort at once, two at a time. A block alone "
    "never waits, and no cohort waits for a long block's part", (READOUT,), minimum=1,
    unset="`STATEBLOCK_READOUT_COHORT_LANES`: only a full cohort starts beside a running one",
)  # fmt: skip
ENGINE = _setting(
    "ENGINE", str, "reference",
    "the readout engine: `reference`, `onnx` or `torch` (an unknown engine, or one that "
    "cannot load or whose manifest does not match the model, stops the worker at start-up); "
    "`stateblock up`: `auto`, `torch` on a GPU and `reference` on the CPU",
    (READOUT, UP), defaults={UP: "auto"}, chart="readout.engine",
)  # fmt: skip
DATA_PLANE = _setting(
    "DATA_PLANE", str, "bus",
    "how a block's rows travel, chosen at start-up (the signed header always goes over "
    "JetStream): `bus` (the block's payload, any host), `local` (the capture and the readout "
    "in one process: the rows stay on the capture's device in a slot pool, and only this "
    "process's workers receive its blocks), `host` (capture and readout processes on one "
    "host: the rows in POSIX shared memory, /dev/shm, read by that host's workers alone; a "
    "GPU's rows pass through the host) or `ipc` (capture and readout processes on one host "
    "with CUDA: the rows stay in the capture's GPU arena, shared through CUDA IPC, read by "
    "that host's workers on that GPU or a peer); capture and readout must agree",
    (CAPTURE, READOUT, UP), defaults={UP: "local"}, chart=COMPUTED,
)  # fmt: skip
API_KEY = _setting(
    "API_KEY", str, None,
    "clients send `Authorization: Bearer KEY` (HTTP; 401 in OpenAI's shape without it) or "
    "`authorization` metadata (gRPC; UNAUTHENTICATED); `/health`, `/metrics`, `/version` "
    "and gRPC health stay open", (GATEWAY, UP, ASK), unset="none (open)", chart=OPTIONAL,
)  # fmt: skip

CAPTURE_TOKEN_FILE = _setting(
    "CAPTURE_TOKEN_FILE", Path, None,
    "a file holding the internal token the gateway sends on every Capture call "
    "(`authorization: Bearer` metadata) and the capture requires (UNAUTHENTICATED without "
    "it; gRPC health stays open); `stateblock up` and the chart generate it",
    (GATEWAY, CAPTURE), unset="none (the capture binds loopback only)", chart=COMPUTED,
)  # fmt: skip

# --- the gateway -----------------------------------------------------------------------------
CAPTURE_TARGET = _setting(
    "CAPTURE_TARGET", str, "127.0.0.1:50061", "the capture service's gRPC address", (GATEWAY,),
    chart=COMPUTED,
)  # fmt: skip
GATEWAY_HOST = _setting(
    "GATEWAY_HOST", str, "0.0.0.0", "the address the gateway's servers bind", (GATEWAY, UP),
    defaults={UP: "127.0.0.1"},
)  # fmt: skip
HTTP_PORT = _setting(
    "HTTP_PORT", int, 8000, "the OpenAI HTTP port (0: any free port)", (GATEWAY, UP),
    minimum=0, chart="gateway.ports.http",
)  # fmt: skip
GRPC_PORT = _setting(
    "GRPC_PORT", int, 50051, "the gRPC Gateway port (0: any free port)", (GATEWAY, UP),
    minimum=0, chart="gateway.ports.grpc",
)  # fmt: skip
REQUEST_TIMEOUT_S = _setting(
    "REQUEST_TIMEOUT_S", float, 60.0, "how long a request waits for its outcome", (GATEWAY,),
    chart="gateway.requestTimeoutSeconds",
)  # fmt: skip
STREAM_CHUNK_TOKENS = _setting(
    "STREAM_CHUNK_TOKENS", int, 16, "tokens per streamed chunk (at most 64 chunks a choice)",
    (GATEWAY,), minimum=1,
)  # fmt: skip
MAX_BODY_BYTES = _setting(
    "MAX_BODY_BYTES", int, 4 << 20, "a larger HTTP request body is a 413, unread", (GATEWAY,),
    minimum=1024,
)  # fmt: skip
IDEMPOTENCY_TTL_S = _setting(
    "IDEMPOTENCY_TTL_S", float, 600.0,
    "how long an `Idempotency-Key` is remembered (a retry with it finds its first answer)",
    (GATEWAY,),
)  # fmt: skip
TLS_CERT_FILE = _setting(
    "TLS_CERT_FILE", Path, None,
    "HTTPS and gRPC over TLS: the certificate chain (PEM; with `STATEBLOCK_TLS_KEY_FILE`)",
    (GATEWAY,), unset="none (plaintext)",
)  # fmt: skip
TLS_KEY_FILE = _setting(
    "TLS_KEY_FILE", Path, None, "its private key (PEM; both or neither)", (GATEWAY,),
    unset="none (plaintext)",
)  # fmt: skip

# --- the capture service -------------------------------------------------------------------
CAPTURE_HOST = _setting(
    "CAPTURE_HOST", str, None,
    "the address the capture's gRPC server binds; a non-loopback address without "
    "`STATEBLOCK_CAPTURE_TOKEN_FILE` is a start-up error", (CAPTURE,),
    unset="`0.0.0.0` with a token, else `127.0.0.1`",
)  # fmt: skip
CAPTURE_PORT = _setting(
    "CAPTURE_PORT", int, 50061, "the capture's gRPC port (0: any free port)", (CAPTURE,),
    minimum=0, chart="capture.ports.grpc",
)  # fmt: skip
CAPTURE_MAX_CONNECTION_AGE_S = _setting(
    "CAPTURE_MAX_CONNECTION_AGE_S", float, 60.0,
    "a gateway's connection to the capture is closed after this long (calls in flight get "
    "as long again to finish), so gateways resolve the capture's address again and spread "
    "over replicas added since (0: never)", (CAPTURE,),
    zero_ok=True, chart="capture.maxConnectionAgeSeconds",
)  # fmt: skip
KEY_DIR = _setting(
    "KEY_DIR", Path, Path("keys"), "the capture's signing key directory (generated on first run)",
    (CAPTURE,), chart=COMPUTED,
)  # fmt: skip
CAPTURE_DTYPE = _setting(
    "CAPTURE_DTYPE", str, "float32", "the base model's dtype (`bfloat16` on a GPU)", (CAPTURE,),
    chart="capture.dtype",
)  # fmt: skip
BATCH_WINDOW_S = _setting(
    "BATCH_WINDOW_S", float, 0.0,
    "0: continuous batching; >0 waits that long for more requests to share a forward",
    (CAPTURE,), zero_ok=True, chart="capture.batchWindowSeconds",
)  # fmt: skip
CAPTURE_COMPILE = _setting(
    "CAPTURE_COMPILE", str, None,
    "`off`, a `torch.compile` backend (`inductor`) or mode (`default`: the fastest under load "
    "on a GPU; `reduce-overhead`: one CUDA graph per shape) for the base forward, every "
    "(lane bucket, prompt bucket) shape compiled by a warm-up before the capture is SERVING; "
    "a prompt's rows are the same alone as in any cohort",
    (CAPTURE,), chart="capture.compile", unset="`default` on a CUDA device, `off` on the CPU",
)  # fmt: skip
CAPTURE_COMPILE_CACHE = _setting(
    "CAPTURE_COMPILE_CACHE", Path, None,
    "compiled only: a directory for inductor's and Triton's caches (compiled graphs, kernels, "
    "autotuning results), kept across restarts so a capture that starts again on the same "
    "model and machine warms up from it", (CAPTURE,), chart=OPTIONAL,
    unset="torch's own, under the temp directory",
)  # fmt: skip
CAPTURE_COHORT_LANES = _setting(
    "CAPTURE_COHORT_LANES", int, 32,
    "lanes one base forward carries at most, from as many requests as fit (never fewer than "
    "`STATEBLOCK_MAX_LANES`: a request's lanes share a forward unless they are over "
    "`STATEBLOCK_CAPTURE_COHORT_TOKENS`)", (CAPTURE,), minimum=1,
    chart="capture.cohortLanes",
)  # fmt: skip
CAPTURE_COHORT_TOKENS = _setting(
    "CAPTURE_COHORT_TOKENS", int, 16384,
    "padded prompt tokens (lanes x bucket width) one base forward carries at most: many short "
    "prompts or a few long ones; a request over it is captured in parts (as many lanes a "
    "forward as fit, one at least) beside the others' forwards", (CAPTURE,), minimum=1,
    chart="capture.cohortTokens",
)  # fmt: skip
CAPTURE_PART_TOKENS = _setting(
    "CAPTURE_PART_TOKENS", int, None,
    "padded prompt tokens one part of a request over `STATEBLOCK_CAPTURE_COHORT_TOKENS` "
    "carries at most (as many lanes as fit, one at least). On a GPU a running kernel is not "
    "preempted, whatever its stream's priority, so a small request's forward beside a part "
    "waits for the part's kernels one by one: smaller parts, shorter waits. Compiled, a part "
    "still runs `STATEBLOCK_CAPTURE_MIN_LANES` lanes at least (dummy ones added)",
    (CAPTURE,), minimum=1, unset="`STATEBLOCK_CAPTURE_COHORT_TOKENS`",
)  # fmt: skip
CAPTURE_PART_SMS = _setting(
    "CAPTURE_PART_SMS", int, None,
    "on a GPU, the streaming multiprocessors a part of a request over "
    "`STATEBLOCK_CAPTURE_COHORT_TOKENS` runs on: a CUDA green context of that many, so a "
    "part's kernels never hold the SMs the cohorts' need (a stream priority only orders "
    "kernels not yet placed; the part runs on the green context's stream). Needs a torch "
    "built with green contexts; ignored off a GPU. Measured on an H100 with torch 2.11: "
    "every answer right, p90 beside a maximal request lower, p99 not (docs/BENCHMARKS.md)",
    (CAPTURE,), minimum=1, unset="every SM, as the cohorts",
)  # fmt: skip
CAPTURE_PART_CHUNK_TOKENS = _setting(
    "CAPTURE_PART_CHUNK_TOKENS", int, None,
    "a prompt lane longer than this many tokens is captured this many positions at a time "
    "(chunked prefill through a KV cache, the backbone's eager forward at fixed shapes, on a GPU "
    "replayed from CUDA graphs recorded at the warm-up), a chunk a turn of "
    "the parts' runner, which `STATEBLOCK_CAPTURE_PART_YIELD_S` holds back for the cohorts: "
    "a small request beside it then shares the device with one chunk, not a whole lane. The "
    "rows are those of one forward up to rounding, and a long prompt runs in chunks whatever "
    "its company, so its answer does not depend on it. Attention-only bases (a Mamba hybrid "
    "is refused at start-up)", (CAPTURE,), minimum=1,
    unset="a lane a forward",
)  # fmt: skip
CAPTURE_PART_YIELD_S = _setting(
    "CAPTURE_PART_YIELD_S", float, 0.0,
    "a part of a request over `STATEBLOCK_CAPTURE_COHORT_TOKENS` does not start while cohort "
    "forwards run or wait, for up to this long a part: a small request's forward then has "
    "the device but for a part already running (with `STATEBLOCK_CAPTURE_PART_CHUNK_TOKENS`, "
    "one chunk; docs/BENCHMARKS.md); 0: parts run beside the cohorts", (CAPTURE,),
    zero_ok=True,
)  # fmt: skip
CAPTURE_FORWARDS = _setting(
    "CAPTURE_FORWARDS", int, None,
    "cohort forwards the capture runs at once, each on a thread and CUDA stream of its own: "
    "with 2 the device runs the next cohort while the last one's rows go out; a forward that "
    "replays CUDA graphs (`reduce-overhead`) runs one (a graph is its recording thread's)",
    (CAPTURE,), minimum=1, unset="2 on a CUDA device, 1 on the CPU (a forward there already "
    "uses every core)",
)  # fmt: skip
CAPTURE_MIN_LANES = _setting(
    "CAPTURE_MIN_LANES", int, 2,
    "compiled only: the fewest lanes a cohort forward runs, a lone request padded with dummy "
    "lanes up to it. 2 runs a request alone through the graph its company runs; 1 runs it "
    "as one lane through that same graph, compiled with the lane count "
    "unbacked (no graph of its own for one lane). On an H100 (torch 2.11) that graph compiles "
    "and keeps every answer as alone, but its one-lane forward took 16.8 ms against the "
    "two-lane graph's 14.5 (docs/BENCHMARKS.md), so a lone request is not faster with 1",
    (CAPTURE,), minimum=1, chart="capture.minLanes",
)  # fmt: skip
CAPTURE_ROPE_MODES = ("fused", "table")
CAPTURE_ROPE = _setting(
    "CAPTURE_ROPE", str, CAPTURE_ROPE_MODES[0],
    "compiled only: where the rotary embedding's cos and sin are evaluated. `fused`: inductor "
    "evaluates them in float32 inside every layer's rotary kernel, for each element of each "
    "head; `table`: once a forward, in the model's dtype as eager transformers does, and "
    "every layer reads them (fewer transcendental ops a forward; the rows round as eager's). "
    "On an H100 a 30-lane forward took 3.1 % less with `table`; `fused` stays the default "
    "until the readout's fidelity on the table's rows is measured on a GPU",
    (CAPTURE,),
)  # fmt: skip
CAPTURE_LANE_BUCKETS = _setting(
    "CAPTURE_LANE_BUCKETS", tuple, (1, 2, 4, 8, 16, 32),
    "compiled only: the lane counts the warm-up runs every prompt bucket at before the "
    "capture is SERVING (the cohort's lane limit is always one; fewer buckets are fewer "
    "shapes to warm up); a forward that replays CUDA graphs (`reduce-overhead`) also pads a "
    "cohort up to its bucket with dummy lanes, one graph per shape, while other modes run "
    "a cohort at its own lane count through one symbolic graph",
    (CAPTURE,), minimum=1, chart="capture.laneBuckets",
)  # fmt: skip
BLOCK_TTL_S = _setting(
    "BLOCK_TTL_S", float, 120.0, "how long a signed block stays valid", (CAPTURE,),
    chart="capture.blockTtlSeconds",
)  # fmt: skip
FORWARD_STATE_DIGEST = _setting(
    "FORWARD_STATE_DIGEST", str, envelope.DEFAULT_FORWARD_STATE_ALGORITHM,
    "the hash of the block's forward-state digest, `blake3` or `sha256`; the signed header "
    "names it and every worker reads both", (CAPTURE,),
)  # fmt: skip
DATA_PLANE_SLOTS = _setting(
    "DATA_PLANE_SLOTS", int, 64,
    "`local` and `host` data planes: blocks whose rows the capture holds at once (slots, "
    "shared-memory regions), until their commit, rejection or expiry; a capture with every "
    "slot held waits up to "
    "`STATEBLOCK_PUBLISH_TIMEOUT_S` for one, then fails UNAVAILABLE", (CAPTURE,), minimum=1,
)  # fmt: skip
DATA_PLANE_ARENA_MB = _setting(
    "DATA_PLANE_ARENA_MB", int, 2048,
    "`ipc` data plane: the capture's device arena that holds the rows of blocks not yet read "
    "(MiB, allocated at start-up; the largest block, 8 lanes of a 4,096-token prompt at "
    "width 2,688 in bf16, is 168 MiB)", (CAPTURE,), minimum=1,
)  # fmt: skip
PUBLISH_TIMEOUT_S = _setting(
    "PUBLISH_TIMEOUT_S", float, 20.0,
    "how long a publish is retried (same `Nats-Msg-Id`) through an election before the "
    "request is a 503", (CAPTURE,),
)  # fmt: skip
CAPTURE_METRICS_PORT = _setting(
    "CAPTURE_METRICS_PORT", int, None, "the capture's Prometheus `/metrics` port", (CAPTURE,),
    unset="off", chart="capture.ports.metrics",
)  # fmt: skip

# --- the readout service -------------------------------------------------------------------
TORCH_ONLY = "`torch` engine only: "
MATMUL_PRECISION = _setting(
    "MATMUL_PRECISION", str, "highest",
    TORCH_ONLY + "`high` runs the decoder's linears in TF32 through torch's process-wide "
    "switch, for a readout process of its own (not the embedded stack, where the capture's "
    "fp32 matmuls would follow it); the engine's own kernels use TF32 dots either way",
    (READOUT,),
)  # fmt: skip
READOUT_HEAD = _setting(
    "READOUT_HEAD", str, "",
    TORCH_ONLY + "`fused` (the vocabulary top-2 against lm_head @ out.weight, d_r wide) or "
    "`lm_head` (hidden states against the lm_head itself)", (READOUT,),
    unset="the engine's (`fused` on a GPU)",
)  # fmt: skip
GREEDY_DTYPE = _setting(
    "GREEDY_DTYPE", str, "",
    TORCH_ONLY + "cohorts of plain greedy lanes (no sampling, no log-probabilities) run on a "
    "`bfloat16` copy of the decoder, fused head and guess table; other cohorts keep the "
    "exact path; `float32` keeps every cohort exact (`float16` is refused: the decoder's "
    "residual stream overflows it). A decoder of your own needs its own "
    "`stateblock audit --engine torch --greedy-dtype bfloat16` (docs/PARITY.md)", (READOUT,),
    unset="the engine's (`bfloat16` on a GPU, off on the CPU)",
)  # fmt: skip
TRUSTED_KEYS_DIR = _setting(
    "TRUSTED_KEYS_DIR", Path, Path("keys"), "trusted capture keys (`*.pub`)", (READOUT,),
    fallback=KEY_DIR, chart=COMPUTED,
)  # fmt: skip
READOUT_KEY_DIR = _setting(
    "READOUT_KEY_DIR", Path, Path("readout-keys"),
    "the key that signs the worker's claims, commits and rejections (generated on first run)",
    (READOUT,), chart=COMPUTED,
)  # fmt: skip
WORKER_ID = _setting(
    "WORKER_ID", str, "", "the id its claims and commits carry", (READOUT,),
    unset="host name and pid",
)  # fmt: skip
LEASE_S = _setting(
    "LEASE_S", float, 10.0,
    "the claim lease; a live worker renews it (and JetStream's ack timer) every lease / 3, so "
    "it bounds only how long a dead worker holds a block", (READOUT,),
    chart="readout.leaseSeconds",
)  # fmt: skip
ACK_WAIT_S = _setting(
    "ACK_WAIT_S", float, 15.0,
    "JetStream's redelivery timer; above the lease, at most half the request timeout",
    (READOUT,), chart="readout.ackWaitSeconds",
)  # fmt: skip
MAX_DELIVER = _setting(
    "MAX_DELIVER", int, 8, "deliveries of a block before a `max_deliveries` rejection",
    (READOUT,), minimum=1, chart="readout.maxDeliver",
)  # fmt: skip
FETCH_TIMEOUT_S = _setting(
    "FETCH_TIMEOUT_S", float, 0.5, "how long an idle worker's pull waits (and notices a stop)",
    (READOUT,),
)  # fmt: skip
RETRY_DELAY_S = _setting(
    "RETRY_DELAY_S", float, 1.0,
    "the nak delay of a block another worker holds a live claim on", (READOUT,),
)  # fmt: skip
READOUT_METRICS_PORT = _setting(
    "READOUT_METRICS_PORT", int, None, "the readout's Prometheus `/metrics` port", (READOUT,),
    unset="off", chart="readout.ports.metrics",
)  # fmt: skip
READOUT_HEALTH_PORT = _setting(
    "READOUT_HEALTH_PORT", int, None,
    "grpc.health.v1 on the workers' event loop: `\"\"` SERVING while NATS is connected and "
    "the engine answers, `liveness` while the loop runs", (READOUT,), unset="off",
    chart="readout.ports.health",
)  # fmt: skip

# --- stateblock up ---------------------------------------------------------------------------
DATA_DIR = _setting(
    "DATA_DIR", Path, Path(".stateblock"), "the embedded NATS store, keys, the capture token and logs", (UP,),
)  # fmt: skip

BY_NAME = {s.name: s for s in SETTINGS}
LIMITS = {"max_lanes": MAX_LANES, "prompt_len_max": PROMPT_LEN_MAX,
          "answer_depth_max": ANSWER_DEPTH_MAX}  # fmt: skip


# --- configs from the declarations -----------------------------------------------------------


def fields_for(*readers: str) -> Callable[..., Any]:
    """`declared = fields_for(GATEWAY)`, then in the config: `http_port: int = declared(HTTP_PORT)`;
    `fields_for(*SERVICES)` declares the fields of a base class every service's config extends."""
    return lambda setting, **kw: setting.field(*readers, **kw)


def limits_field(*readers: str) -> Any:
    """The config's `limits`: one Limits from MAX_LANES, PROMPT_LEN_MAX, ANSWER_DEPTH_MAX."""
    for s in LIMITS.values():
        s.field(*readers)  # declared for these readers
    reader = readers[0] if len(readers) == 1 else None
    return dataclasses.field(default=Limits(), metadata={"limits": LIMITS, "reader": reader})


def settings_of(config_cls: type) -> list[Setting]:
    """The settings a config's fields hold, in field order."""
    out: list[Setting] = []
    for f in dataclasses.fields(config_cls):
        if "setting" in f.metadata:
            out.append(f.metadata["setting"])
        out.extend(f.metadata.get("limits", {}).values())
    return out


def read_config(config_cls: type[T], environ: Mapping[str, str] | None = None) -> T:
    """`config_cls` with every declared field read from `environ` (os.environ by default);
    raises runtime.ConfigError naming the variable."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        reader = f.metadata.get("reader")
        if "setting" in f.metadata:
            values[f.name] = f.metadata["setting"].read(environ, reader)
        elif "limits" in f.metadata:
            limits = f.metadata["limits"].items()
            values[f.name] = Limits(**{k: s.read(environ, reader) for k, s in limits})
    return config_cls(**values)


# --- the docs and the chart ------------------------------------------------------------------


def _shown(value: Any, unset: str) -> str:
    if value is None or value == "":
        return unset
    if isinstance(value, Path) and value.is_relative_to(runtime.REPO):
        value = value.relative_to(runtime.REPO)
    if isinstance(value, float):
        value = f"{value:g}"
    if isinstance(value, tuple):
        value = ",".join(str(v) for v in value)
    return f"`{value}`"


def shown_default(s: Setting, reader: str | None = None) -> str:
    """The default as the docs show it (`reader`'s own, or the common one with exceptions)."""
    if reader is not None:
        return _shown(s.default_for(reader), s.unset)
    text = _shown(s.default, s.unset)
    if s.fallback is not None:
        text = f"`${s.fallback.name}`, else {text}"
    for who, value in s.defaults.items():
        text += f" ({READER_NAMES.get(who, who)}: {_shown(value, s.unset)})"
    return text


def markdown_table() -> str:
    """The README's configuration table."""
    lines = ["| variable | default | read by: what it is |", "|---|---|---|"]
    for s in SETTINGS:
        readers = ", ".join(READER_NAMES.get(r, r) for r in s.readers)
        lines.append(f"| `{s.name}` | {shown_default(s)} | {readers}: {s.help} |")
    return "\n".join(lines) + "\n"


def chart_variables(component: str, *, optional: bool = False) -> set[str]:
    """What the chart sets on `component`: every setting it reads that the chart carries
    (and the OPTIONAL ones, when their values are given)."""
    carried = {s.chart for s in SETTINGS} - {"", *(() if optional else (OPTIONAL,))}
    return {s.name for s in SETTINGS if component in s.readers and s.chart in carried}
