"""The stack as it is deployed, one process per service: nats-server, `python -m capture_svc`,
`python -m readout_svc` and `python -m gateway`, each with its own interpreter, event loop
and GIL, and the STATEBLOCK_* environment the stack plan (stateblock/app/plan.py) generates
for it: the topology `stateblock up` runs in one process, here one process per service.

With `placement=IN_PROCESS` the same plan runs as one `stateblock up` process instead (every
service on its event loop, the rows in its slot pool), the bench still a process apart.

`bench.stack` runs the same services on one event loop in the bench's process, where the
capture's publish, the worker's read of the same 2.75 MB block and the gateway's reply wait
on each other's turns. This module measures what a deployment pays instead. The services
are seen only from outside: the client's clock, and their Prometheus stage histograms
scraped between requests.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from stateblock import settings
from stateblock.app.nats_server import free_port, nats_server_binary
from stateblock.app.plan import (
    IN_PROCESS,
    LOOPBACK,
    MODULES,
    NATS,
    PROCESSES,
    Ports,
    Service,
    StackPlan,
    capture_names,  # noqa: F401 (bench.procs.capture_names)
    readout_names,  # noqa: F401 (bench.procs.readout_names)
)
from stateblock.app.stack import credentials_wiring
from stateblock.settings import CAPTURE, GATEWAY, READOUT

UP_PROCESS = "stack"  # the one process of an in-process stack
ENGINE_SETTINGS = {  # the readout's engine options (ReadoutServiceConfig.engine_options)
    "matmul_precision": settings.MATMUL_PRECISION,
    "head": settings.READOUT_HEAD,
    "greedy_dtype": settings.GREEDY_DTYPE,
}


def engine_options(args) -> dict[str, str]:
    """The readout engine settings the e2e bench was asked for (--matmul-precision,
    --greedy-dtype)."""
    options = {}
    if args.matmul_precision != "highest":
        options["matmul_precision"] = args.matmul_precision
    if args.greedy_dtype:
        options["greedy_dtype"] = args.greedy_dtype
    return options


REPO = Path(__file__).resolve().parent.parent
# the histograms whose per-request sums the bench reads (what a dashboard would plot)
LOOP_LAG = "stateblock_event_loop_lag_seconds"  # runtime.loop_lag
SCRAPED = (
    "stateblock_capture_seconds",
    "stateblock_capture_stage_seconds",
    "stateblock_readout_stage_seconds",
)


@dataclass(frozen=True)
class ProcStackConfig:
    data_dir: Path
    model_name: str
    base_dir: Path
    decoder_dir: Path
    device: str  # for capture and readout alike
    capture_dtype: str  # "bfloat16" on a GPU
    engine: str
    workers: int | None = None  # None: the readout's default for its engine
    capture_compile: str = "off"
    blocks_storage: str = "file"
    engine_options: dict[str, str] = field(default_factory=dict)  # the readout's: ENGINE_SETTINGS
    nats_max_payload: int = 8 << 20
    ready_timeout_s: float = 600.0
    readout_procs: int = 1  # readout processes (the chaos suite kills and stops some)
    captures: int = 1  # capture processes; the gateway balances over them round-robin
    # STATEBLOCK_* for the services: each gets those its component reads
    extra_env: dict[str, str] = field(default_factory=dict)
    nats_monitor: bool = False  # nats-server's HTTP monitoring (/varz) on a free port
    # IN_PROCESS: one `stateblock up` process (its own nats-server, every service on one
    # event loop, the `local` data plane unless extra_env says otherwise)
    placement: str = PROCESSES

    def plan(self) -> StackPlan:
        """The stack these processes run, every port a free one."""
        values = {
            settings.MODEL_NAME: self.model_name,
            settings.BASE_DIR: self.base_dir,
            settings.DECODER_DIR: self.decoder_dir,
            settings.DEVICE: self.device,
            settings.CAPTURE_DTYPE: self.capture_dtype,
            settings.CAPTURE_COMPILE: self.capture_compile,
            settings.BLOCKS_STORAGE: self.blocks_storage,
            settings.ENGINE: self.engine,
            settings.WORKERS: self.workers,
            settings.LOG_LEVEL: "warning",
            **{ENGINE_SETTINGS[k]: v for k, v in self.engine_options.items()},
            **{_declared(name): value for name, value in self.extra_env.items()},
        }
        c, n = self.captures, self.readout_procs
        ports = Ports(
            http=0, grpc=0, capture=(0,) * c, capture_metrics=(0,) * c, readout_metrics=(0,) * n
        )
        if self.placement == IN_PROCESS:  # the metrics on the gateway's HTTP port
            ports = Ports(http=0, grpc=0)
        plan = StackPlan(
            data_dir=self.data_dir,
            placement=self.placement,
            nats_max_payload=self.nats_max_payload,
            captures=c,
            readout_procs=n,
            ports=ports,
            values=values,
        )
        return plan.with_free_ports(free_port)


def _declared(name: str) -> settings.Setting:
    if name not in settings.BY_NAME:
        raise ValueError(f"{name} is not a STATEBLOCK_* setting (stateblock/settings.py)")
    return settings.BY_NAME[name]


def _families(url: str) -> list:
    """The metric families a service's /metrics gives now."""
    with urllib.request.urlopen(url, timeout=5) as r:
        return list(text_string_to_metric_families(r.read().decode()))


class ProcStack:
    """`start()` launches the processes of the config's plan (nats-server, capture, the
    readout processes, gateway) and returns the gateway's URL; `stop()` ends them (SIGTERM:
    each service drains and stops gracefully)."""

    def __init__(self, config: ProcStackConfig) -> None:
        self.config = config
        self._procs: dict[str, subprocess.Popen] = {}
        self._specs: dict[str, tuple[list[str], dict[str, str]]] = {}
        self._ready: dict[str, Callable[[], bool]] = {}
        self._metrics_urls: list[str] = []
        self._lag_urls: dict[str, str] = {}  # {process: its /metrics}, for its loop's lag
        self.nats_monitor_url: str | None = None  # http://127.0.0.1:PORT, with nats_monitor

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        """Start one process with `env` as its only STATEBLOCK_* variables."""
        self._specs[name] = (argv, env)
        log = (self.config.data_dir / f"{name}.log").open("ab")
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("STATEBLOCK_")}
        full = {**inherited, "PYTHONUNBUFFERED": "1", **env}
        full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full.get("PYTHONPATH")]))
        self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=log, env=full, cwd=REPO)
        log.close()

    def start(self) -> str:
        """Every service of the config's plan, each ready; returns the gateway's URL. On a
        failure, what was started is stopped again."""
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        plan = self.config.plan()
        try:
            return self._start(plan)
        except BaseException:
            self.stop()
            raise

    def _start(self, plan: StackPlan) -> str:
        if plan.placement == IN_PROCESS:
            return self._start_up(plan)
        nats_port = self._start_nats()
        self.nats_url = f"nats://127.0.0.1:{nats_port}"
        wiring = credentials_wiring(plan.data_dir, self.nats_url)
        # the gateway last, once its captures answer: its channel's first connections then
        # reach every capture, so round-robin balances from the first request
        services = sorted(plan.services(), key=lambda s: s.component == GATEWAY)
        for service in services:
            if service.component == GATEWAY:
                for name, ready in self._ready.items():
                    self._wait(ready, name)
            if service.component != NATS:
                argv = [sys.executable, "-m", MODULES[service.component]]
                self._spawn(service.name, argv, plan.env(service, wiring))
            self._ready[service.name] = _probe(service, plan, nats_port)
        p = plan.ports
        self._metrics_urls = [
            f"http://127.0.0.1:{port}/metrics" for port in (*p.capture_metrics, *p.readout_metrics)
        ]
        self._lag_urls = {
            **{
                f"capture{i}": u for i, u in enumerate(self._metrics_urls[: len(p.capture_metrics)])
            },
            **{
                f"readout{i}": u for i, u in enumerate(self._metrics_urls[len(p.capture_metrics) :])
            },
            "gateway": f"http://127.0.0.1:{p.http}/metrics",
        }
        # the capture's gRPC port opens before its warm-up; its health says SERVING after it
        for name, ready in self._ready.items():
            self._wait(ready, name)
        for url in self._metrics_urls:
            self._wait(lambda u=url: _http_ok(u), url)
        return f"http://127.0.0.1:{p.http}"

    def _start_up(self, plan: StackPlan) -> str:
        """One `stateblock up` process: ready once the gateway's /health answers (it starts
        after the capture's warm-up and the workers)."""
        p = plan.ports
        argv = [sys.executable, "-m", "stateblock.app.cli", "up", "--data-dir",
                str(plan.data_dir), "--host", LOOPBACK, "--http-port", str(p.http),
                "--grpc-port", str(p.grpc)]  # fmt: skip
        self._spawn(UP_PROCESS, argv, plan.up_env())
        url = f"http://{LOOPBACK}:{p.http}"
        self._wait(lambda: _http_ok(f"{url}/health"), UP_PROCESS)
        self._metrics_urls = [f"{url}/metrics"]
        self._lag_urls = {UP_PROCESS: f"{url}/metrics"}
        return url

    def _start_nats(self) -> int:
        """nats-server with JetStream on a free port, its store in the data dir."""
        cfg = self.config
        port, conf = free_port(), cfg.data_dir / "nats.conf"
        conf.write_text(f"max_payload: {cfg.nats_max_payload}\n")
        monitor = []
        if cfg.nats_monitor:
            monitor_port = free_port()
            monitor = ["-m", str(monitor_port)]
            self.nats_monitor_url = f"http://127.0.0.1:{monitor_port}"
        self._spawn(
            NATS,
            [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd",
             str(cfg.data_dir / "nats"), "-c", str(conf), *monitor],
            {},
        )  # fmt: skip
        self._wait(lambda: _port_open(port), "nats-server")
        return port

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while not ready():
            dead = {n: p.returncode for n, p in self._procs.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                self.stop()
                logs = {n: _tail(self.config.data_dir / f"{n}.log") for n in self._procs}
                raise RuntimeError(f"{what} not ready (exited: {dead}); logs: {logs}")
            time.sleep(0.2)

    def scrape(self, families: tuple[str, ...] = SCRAPED) -> dict[tuple[str, str], float]:
        """{(sample name, stage label or ''): value} of the histograms' _sum and _count and
        the counters' _total, summed over the services (two readout processes: both) and over
        routes, and by route too where a sample has one (stage `forward.cohort`)."""
        out: dict[tuple[str, str], float] = {}
        for url in self._metrics_urls:
            for family in _families(url):
                if family.name not in families:
                    continue
                for s in family.samples:
                    if s.name.endswith(("_sum", "_count", "_total")):  # summed over the processes
                        key = (s.name, s.labels.get("stage", s.labels.get("event", "")))
                        out[key] = out.get(key, 0.0) + s.value
                        if "route" in s.labels:  # and by route: `forward.cohort`, ...
                            key = (s.name, f"{key[1]}.{s.labels['route']}")
                            out[key] = out.get(key, 0.0) + s.value
        return out

    def loop_lag(self) -> dict[str, dict[float, float]]:
        """{process: {bucket bound in seconds: its loop's wake-ups at most that late so far,
        inf: all of them}} (runtime.loop_lag); a process that does not answer is left out."""
        out: dict[str, dict[float, float]] = {}
        for name, url in self._lag_urls.items():
            try:
                families = _families(url)
            except OSError:
                continue
            for family in families:
                if family.name == LOOP_LAG:
                    out[name] = {
                        float(s.labels["le"]): s.value
                        for s in family.samples
                        if s.name.endswith("_bucket")
                    }
        return out

    @property
    def metrics_urls(self) -> tuple[str, ...]:
        """Each capture's /metrics, then each readout's."""
        return tuple(self._metrics_urls)

    def pids(self) -> dict[str, int]:
        """{service name: process id} of the processes still running (in-process, the
        `stateblock up` process and its nats-server)."""
        out = {n: p.pid for n, p in self._procs.items() if p.poll() is None}
        if UP_PROCESS in out:
            out.update((NATS, pid) for pid in _children(out[UP_PROCESS], "nats-server"))
        return out

    def signal(self, name: str, sig: int) -> None:
        """Send a signal to one service's process (SIGKILL, SIGSTOP, SIGCONT...)."""
        self._procs[name].send_signal(sig)
        if sig == signal.SIGKILL:
            self._procs[name].wait()

    def restart(self, name: str) -> None:
        """Start a service again as it was first started (nats: the same port and store);
        returns once it is ready (its port or its /metrics answers)."""
        proc = self._procs[name]
        if proc.poll() is None:
            raise RuntimeError(f"{name} is still running")
        argv, env = self._specs[name]
        self._spawn(name, argv, env)
        if name in self._ready:
            self._wait(self._ready[name], name)

    def stop(self) -> None:
        # in reverse start order: services first (they drain through NATS), the server last
        for name in reversed(self._procs):
            proc = self._procs[name]
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _probe(service: Service, plan: StackPlan, nats_port: int) -> Callable[[], bool]:
    """Whether the service is ready: nats-server's port is open, the capture's gRPC health
    says SERVING, a readout's /metrics and the gateway's /health answer."""
    if service.component == NATS:
        return lambda: _port_open(nats_port)
    if service.component == CAPTURE:
        return lambda: _grpc_serving(plan.ports.capture[service.index])
    if service.component == READOUT:
        url = f"http://127.0.0.1:{plan.ports.readout_metrics[service.index]}/metrics"
        return lambda: _http_ok(url)
    return lambda: _http_ok(f"http://127.0.0.1:{plan.ports.http}/health")


def _children(pid: int, name: str) -> list[int]:
    """The process's children whose command is `name` (Linux /proc; none elsewhere)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):  # a thread's own children each
        try:
            for child in (task / "children").read_text().split():
                if Path(f"/proc/{child}/comm").read_text().strip() == name:
                    found.append(int(child))
        except OSError:
            continue
    return found


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _grpc_serving(port: int) -> bool:
    """The service's gRPC health ("") says SERVING."""
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_e2e_procs(args, scale, client, stack: ProcStack, model_name: str) -> dict:
    """N sequential requests after a warm-up: the client's latency, and per request the
    services' own stage times (histogram sums before and after it)."""
    from bench.models import bench_prompt
    from bench.report import ms_summary
    from bench.stack import sequential_completions

    rng = random.Random(args.seed)
    ack = ("stateblock_readout_stage_seconds_count", "ack")
    samples: dict[str, list[float]] = {"e2e": []}
    completion, errors = [], []
    prompts = (
        bench_prompt(rng, args.prompt_len, scale.vocab_size) for _ in range(args.warmup + args.n)
    )
    for i, r, t0, t1, before in sequential_completions(
        client, model_name, prompts, args.max_tokens, errors, stack.scrape
    ):
        if i < args.warmup:
            continue
        after = stack.scrape()
        for _ in range(200):  # the worker observes its stages after the ack, past the reply
            if after.get(ack, 0.0) > before.get(ack, 0.0):
                break
            time.sleep(0.005)
            after = stack.scrape()
        samples["e2e"].append(t1 - t0)
        for (name, stage), value in after.items():
            if name.endswith("_sum"):
                prefix = "capture" if "capture" in name else "worker"
                key = f"{prefix}.{stage}" if stage else prefix
                samples.setdefault(key, []).append(value - before.get((name, stage), 0.0))
        completion.append(r["usage"]["completion_tokens"])
    out: dict = {"n_ok": len(samples["e2e"]), "errors": errors[:5], "n_errors": len(errors)}
    if not samples["e2e"]:
        return out
    # the stages that follow each other on the request's path; the capture's publish is
    # left out, since the block's delivery to the worker runs while it waits for the ack
    serial = ("capture.tokenize", "capture.forward", "capture.sign", "worker.verify",
              "worker.claim", "worker.readout", "worker.commit")  # fmt: skip
    samples["outside"] = [  # the bus, gRPC, the gateway and HTTP: what no serial stage covers
        e - sum(samples[k][j] for k in serial if k in samples) for j, e in enumerate(samples["e2e"])
    ]
    out.update(
        completion_tokens={"min": min(completion), "max": max(completion)},
        all_full_depth=all(c == args.max_tokens for c in completion),
        latency=ms_summary(samples["e2e"]),
        breakdown={k: ms_summary(v) for k, v in samples.items() if k != "e2e" and v},
        partition="e2e = capture.tokenize/forward/sign + worker.verify/claim/readout/commit"
        " + outside",
    )
    return out


def serve_processes(args, scale, base, device: str, report, model_name: str) -> None:
    """The e2e stage on the process stack, over the base and decoder the bench saved."""
    from bench.stack import CompletionsClient

    cuda = device.startswith("cuda")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32")
    config = ProcStackConfig(
        data_dir=base.base_dir.parent / "procs",
        model_name=model_name,
        base_dir=base.base_dir,
        decoder_dir=base.decoder_dir,
        device=device,
        capture_dtype=dtype,
        engine=args.engine,
        workers=args.workers,
        capture_compile=args.capture_compile,
        blocks_storage=args.blocks_storage,
        engine_options=engine_options(args),
        nats_max_payload=args.nats_max_payload,
        extra_env={"STATEBLOCK_FORWARD_STATE_DIGEST": args.forward_state_digest},
    )
    report.doc["config"].update(stack="processes", capture_compile=args.capture_compile,
                                blocks_storage=args.blocks_storage,
                                forward_state_digest=args.forward_state_digest)  # fmt: skip
    stack = ProcStack(config)
    t0 = time.perf_counter()
    url = stack.start()
    report.doc["setup"]["stack_start_s"] = time.perf_counter() - t0
    report.write()
    client = CompletionsClient(url, timeout=300.0)
    try:
        report.set("e2e", run_e2e_procs(args, scale, client, stack, model_name))
    finally:
        client.close()
        stack.stop()
