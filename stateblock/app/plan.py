"""The stack plan: one description of a stack's topology, whatever runs it.

A `StackPlan` says which services a stack runs (its own nats-server or an external NATS,
capture processes the gateway balances over, readout processes of `STATEBLOCK_WORKERS` pull
loops each, one gateway), on which ports, where (`IN_PROCESS`: every service on one event
loop; `PROCESSES`: one process per service), and the settings it gives them. Each service's environment is generated from the
plan and the stack's wiring (`StackPlan.env`), holding only settings its component reads
(`stateblock.settings`), so every placement configures a service the same way:

- `stateblock up` (`stack.running_stack`) reads each in-process service's config from that
  environment (`StackPlan.config`);
- `bench/procs.py` (the benchmarks and the chaos suite) starts `python -m <module>` per service
  with it;
- `tests/unit/deploy` renders the Helm chart and checks its Deployments and their env against
  the plan for the same values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stateblock import runtime
from stateblock import settings as s
from stateblock.settings import CAPTURE, GATEWAY, READOUT, SERVICES, Setting

IN_PROCESS, PROCESSES = "in-process", "processes"
NATS = "nats"  # the stack's own nats-server: a service that reads no settings
LOOPBACK = "127.0.0.1"
MODULES = {GATEWAY: "gateway", CAPTURE: "capture_svc", READOUT: "readout_svc"}  # python -m

# What the plan sets from its topology and the stack's wiring, never from `values`.
WIRING = frozenset({
    s.NATS_URL, s.CAPTURE_TARGET, s.CAPTURE_HOST, s.CAPTURE_PORT, s.GATEWAY_HOST, s.HTTP_PORT,
    s.GRPC_PORT, s.METRICS_HOST, s.CAPTURE_METRICS_PORT, s.READOUT_METRICS_PORT,
    s.READOUT_HEALTH_PORT, s.KEY_DIR, s.TRUSTED_KEYS_DIR, s.READOUT_KEY_DIR,
    s.READOUT_TRUSTED_KEYS_DIR, s.CAPTURE_TOKEN_FILE, s.WORKER_ID,
})  # fmt: skip


@dataclass(frozen=True)
class Service:
    name: str  # its process's (and log file's) name: "nats", "capture", "readout-0", "gateway"
    component: str  # NATS, or the settings reader: GATEWAY, CAPTURE, READOUT
    index: int = 0  # among its component's processes


@dataclass(frozen=True)
class Ports:
    """0: any free port (the server's pick in-process; `StackPlan.with_free_ports` before
    processes start); None or no entry: not served."""

    http: int = s.HTTP_PORT.default
    grpc: int = s.GRPC_PORT.default
    capture: tuple[int, ...] = (0,)  # one gRPC port per capture process
    capture_metrics: tuple[int, ...] = ()  # one per capture process, or none
    readout_metrics: tuple[int, ...] = ()  # one per readout process, or none
    readout_health: tuple[int, ...] = ()  # one per readout process, or none


@dataclass(frozen=True)
class Wiring:
    """What a stack has once it starts: its NATS and its credentials' files."""

    nats_url: str
    key_dir: Path  # the capture's signing key; its public half is what the readout trusts
    readout_key_dir: Path  # the readout's signing key; what the gateway and the readout trust
    token_file: Path  # the gateway's credential at the capture
    capture_port: int | None = None  # the one capture's bound port, when the plan said 0


def capture_names(n: int) -> list[str]:
    return ["capture"] if n == 1 else [f"capture-{i}" for i in range(n)]


def readout_names(n: int) -> list[str]:
    return ["readout"] if n == 1 else [f"readout-{i}" for i in range(n)]


@dataclass(frozen=True)
class StackPlan:
    """Which services, how many, on which ports, where, configured how (the module's doc)."""

    data_dir: Path  # keys, the capture token, its own nats-server's store, logs
    placement: str = IN_PROCESS
    nats_url: str | None = None  # None: the stack starts its own nats-server in data_dir
    nats_max_payload: int | None = None  # its own server's max_payload (None: 1 MiB)
    captures: int = 1  # capture processes; the gateway balances over them round-robin
    readout_procs: int = 1  # readout processes, each with STATEBLOCK_WORKERS pull loops
    host: str = LOOPBACK  # where the gateway and /metrics bind; the capture binds loopback
    ports: Ports = Ports()
    # every other setting the stack gives its services, each to the components that read it
    values: Mapping[Setting, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.placement not in (IN_PROCESS, PROCESSES):
            raise ValueError(f"placement must be {IN_PROCESS!r} or {PROCESSES!r}")
        for n in (self.captures, self.readout_procs):
            if n < 1 or (self.placement == IN_PROCESS and n != 1):
                raise ValueError("in-process, a stack runs one capture and one readout process")
        p = self.ports
        per_process = [(self.captures, p.capture), (self.captures, p.capture_metrics or None),
                       (self.readout_procs, p.readout_metrics or None),
                       (self.readout_procs, p.readout_health or None)]  # fmt: skip
        if any(ports is not None and len(ports) != n for n, ports in per_process):
            raise ValueError("ports of the capture and readout processes: one per process")
        for setting in self.values:
            if setting in WIRING or not set(setting.readers) & set(SERVICES):
                raise ValueError(f"{setting.name} is not a setting the plan gives its services")
            self.value(setting)  # one that cannot be read stops the plan, not a service
        if self.value(s.DATA_PLANE) == "local" and self.placement != IN_PROCESS:
            raise ValueError(
                "STATEBLOCK_DATA_PLANE=local keeps the rows in the capture's process: "
                "only an in-process stack can read them"
            )
        # a block a dead worker held must come back while its request still waits
        runtime.check_redelivery(self.value(s.ACK_WAIT_S), self.value(s.REQUEST_TIMEOUT_S))

    def value(self, setting: Setting) -> Any:
        """The setting's value in this plan, parsed as its readers parse it (its default
        where the plan sets none); raises runtime.ConfigError naming the variable."""
        value = self.values.get(setting)
        return setting.read({} if value is None else {setting.name: _text(value)})

    def services(self) -> tuple[Service, ...]:
        """Every service in start order (the reverse is the stop order)."""
        own = (Service(NATS, NATS),) if self.nats_url is None else ()
        names = readout_names(self.readout_procs)
        readouts = tuple(Service(name, READOUT, i) for i, name in enumerate(names))
        names = capture_names(self.captures)
        captures = tuple(Service(name, CAPTURE, i) for i, name in enumerate(names))
        return (*own, *captures, *readouts, Service(GATEWAY, GATEWAY))

    def service(self, component: str, index: int = 0) -> Service:
        return next(x for x in self.services() if (x.component, x.index) == (component, index))

    def with_free_ports(self, pick: Callable[[], int]) -> StackPlan:
        """Every port 0 replaced by `pick()`: what a stack of processes wires up front."""

        def free(port):
            return pick() if port == 0 else port

        p = self.ports
        ports = Ports(
            http=free(p.http),
            grpc=free(p.grpc),
            capture=tuple(map(free, p.capture)),
            capture_metrics=tuple(map(free, p.capture_metrics)),
            readout_metrics=tuple(map(free, p.readout_metrics)),
            readout_health=tuple(map(free, p.readout_health)),
        )
        return dataclasses.replace(self, ports=ports)

    def env(self, service: Service, wiring: Wiring) -> dict[str, str]:
        """The STATEBLOCK_* environment `service` runs with: exactly the settings of the plan
        its component reads (unset ones left to their defaults)."""
        if service.component == NATS:
            return {}
        chosen = {**self._wiring(service, wiring), **self.values}
        return {
            setting.name: _text(value)
            for setting, value in chosen.items()
            if service.component in setting.readers and value is not None and value != ""
        }

    def up_env(self) -> dict[str, str]:
        """The STATEBLOCK_* environment under which `stateblock up` (flags for its ports and
        data dir) runs this plan's values: its flags' defaults and its services' settings."""
        if self.placement != IN_PROCESS:
            raise ValueError("`stateblock up` runs an in-process plan")
        return {
            setting.name: _text(value)
            for setting, value in self.values.items()
            if value is not None and value != ""
        }

    def config(self, service: Service, wiring: Wiring) -> Any:
        """The service's typed config, read from `env` as its own process would."""
        from capture_svc.config import CaptureConfig
        from gateway.config import GatewayConfig
        from readout_svc.config import ReadoutServiceConfig

        configs = {GATEWAY: GatewayConfig, CAPTURE: CaptureConfig, READOUT: ReadoutServiceConfig}
        return configs[service.component].from_env(self.env(service, wiring))

    def capture_target(self, wiring: Wiring) -> str:
        """The gateway's STATEBLOCK_CAPTURE_TARGET: one address, or grpc's `ipv4:` list of
        every capture process, which the gateway balances round-robin."""
        ports = self.ports.capture if wiring.capture_port is None else (wiring.capture_port,)
        targets = [f"{LOOPBACK}:{port}" for port in ports]
        return targets[0] if len(targets) == 1 else "ipv4:" + ",".join(targets)

    def _wiring(self, service: Service, w: Wiring) -> dict[Setting, Any]:
        p = self.ports
        own_ports = {  # each process of a component has its own
            CAPTURE: {s.CAPTURE_PORT: p.capture, s.CAPTURE_METRICS_PORT: p.capture_metrics},
            READOUT: {s.READOUT_METRICS_PORT: p.readout_metrics,
                      s.READOUT_HEALTH_PORT: p.readout_health},
        }.get(service.component, {})  # fmt: skip
        return {
            s.NATS_URL: w.nats_url,
            s.KEY_DIR: w.key_dir,
            s.TRUSTED_KEYS_DIR: w.key_dir,
            s.READOUT_KEY_DIR: w.readout_key_dir,
            s.READOUT_TRUSTED_KEYS_DIR: w.readout_key_dir,
            s.CAPTURE_TOKEN_FILE: w.token_file,
            s.CAPTURE_HOST: LOOPBACK,  # only the gateway calls it
            s.CAPTURE_TARGET: self.capture_target(w),
            s.GATEWAY_HOST: self.host,
            s.HTTP_PORT: p.http,
            s.GRPC_PORT: p.grpc,
            s.METRICS_HOST: self.host,
            **{setting: ports[service.index] for setting, ports in own_ports.items() if ports},
            # in-process, the worker ids are the host's and the process's (one process)
            s.WORKER_ID: service.name if self.placement == PROCESSES else None,
        }


def _text(value: Any) -> str:
    """A setting's value as its variable holds it (`Setting.read` parses it back)."""
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)
