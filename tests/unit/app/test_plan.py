"""The stack plan (stateblock/app/plan.py): one topology from which `stateblock up` builds its
in-process services' configs and bench/procs.py its processes' environments, each service
given exactly settings its component reads (tests/unit/deploy checks the chart against it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.procs import ProcStack, ProcStackConfig
from capture_svc.config import CaptureConfig
from readout_svc.config import ReadoutServiceConfig
from stateblock import settings
from stateblock.app.plan import (
    IN_PROCESS,
    NATS,
    PROCESSES,
    Ports,
    StackPlan,
    Wiring,
)
from stateblock.app.plan import WIRING as WIRING_SETTINGS
from stateblock.app.stack import UpConfig
from stateblock.runtime import ConfigError

WIRING = Wiring("nats://127.0.0.1:4222", Path("/d/keys"), Path("/d/readout-keys"), Path("/d/tok"))


def _procs(**kw) -> ProcStackConfig:
    fields = dict(
        data_dir=Path("/d"), model_name="org/m-1", base_dir=Path("/m/base"),
        decoder_dir=Path("/m/dec"), device="cpu", capture_dtype="float32", engine="reference",
    )  # fmt: skip
    return ProcStackConfig(**{**fields, **kw})


def _declared_readers(plan: StackPlan) -> None:
    for service in plan.services():
        for name in plan.env(service, WIRING):
            assert service.component in settings.BY_NAME[name].readers, (service.name, name)


def test_up_runs_every_service_in_process_from_one_plan():
    config = UpConfig(data_dir=Path("/d"), workers=3, http_port=0, api_key="k", grace_s=2.0)
    plan = config.plan()
    assert plan.placement == IN_PROCESS
    assert [s.name for s in plan.services()] == [NATS, "capture", "readout", "gateway"]
    _declared_readers(plan)
    capture = plan.config(plan.service("capture"), WIRING)
    readout = plan.config(plan.service("readout"), WIRING)
    gateway = plan.config(plan.service("gateway"), Wiring(**{**vars(WIRING), "capture_port": 7}))
    assert capture.bind_host == "127.0.0.1" and capture.token_file == WIRING.token_file
    assert (capture.key_dir, readout.trusted_keys_dir) == (WIRING.key_dir, WIRING.key_dir)
    assert readout.signing_key_dir == gateway.readout_trusted_keys_dir == WIRING.readout_key_dir
    assert (readout.workers, readout.worker_id, readout.metrics_port) == (3, "", None)
    assert gateway.capture_target == "127.0.0.1:7"  # the port the capture bound
    assert (gateway.http_port, gateway.api_key, gateway.capture_token_file) == (
        0,
        "k",
        WIRING.token_file,
    )
    assert {c.grace_s for c in (capture, readout, gateway)} == {2.0}
    assert {c.nats_url for c in (capture, readout, gateway)} == {WIRING.nats_url}
    external = UpConfig(data_dir=Path("/d"), nats_url="nats://a:4222").plan()
    assert NATS not in [s.component for s in external.services()]


def test_processes_get_free_ports_and_exactly_the_settings_they_read():
    plan = _procs(
        readout_procs=2, workers=1, engine_options={},
        extra_env={"STATEBLOCK_LEASE_S": "2", "STATEBLOCK_ACK_WAIT_S": "4"},
    ).plan()  # fmt: skip
    assert plan.placement == PROCESSES
    assert [s.name for s in plan.services()] == [
        NATS,
        "capture",
        "readout-0",
        "readout-1",
        "gateway",
    ]
    p = plan.ports
    ports = [p.http, p.grpc, *p.capture, *p.capture_metrics, *p.readout_metrics]
    assert 0 not in ports and len(set(ports)) == len(ports) == 6
    _declared_readers(plan)
    envs = {s.name: plan.env(s, WIRING) for s in plan.services()}
    assert envs[NATS] == {}
    # the extra settings reach their readers only
    assert envs["readout-1"]["STATEBLOCK_LEASE_S"] == "2"
    assert "STATEBLOCK_LEASE_S" not in envs["capture"] | envs["gateway"]
    readouts = [plan.config(plan.service("readout", i), WIRING) for i in (0, 1)]
    assert [r.worker_id for r in readouts] == ["readout-0", "readout-1"]
    assert [r.metrics_port for r in readouts] == list(p.readout_metrics)
    assert {(r.lease_s, r.ack_wait_s, r.workers) for r in readouts} == {(2.0, 4.0, 1)}
    gateway = plan.config(plan.service("gateway"), WIRING)
    assert gateway.capture_target == f"127.0.0.1:{p.capture[0]}"
    assert plan.config(plan.service("capture"), WIRING).metrics_port == p.capture_metrics[0]


def test_the_gateway_balances_over_every_capture_process():
    plan = _procs(captures=2).plan()
    captures = [plan.service("capture", i) for i in (0, 1)]
    assert [c.name for c in captures] == ["capture-0", "capture-1"]
    configs = [plan.config(c, WIRING) for c in captures]
    assert [(c.port, c.metrics_port) for c in configs] == list(
        zip(plan.ports.capture, plan.ports.capture_metrics, strict=True)
    )
    gateway = plan.config(plan.service("gateway"), WIRING)
    assert gateway.capture_target == "ipv4:" + ",".join(
        f"127.0.0.1:{port}" for port in plan.ports.capture
    )


def test_engine_options_reach_the_readout_only():
    plan = _procs(
        engine="torch", engine_options={"greedy_dtype": "float32", "head": "lm_head"}
    ).plan()
    readout = plan.config(plan.service("readout"), WIRING)
    assert readout.engine_options() == {"greedy_dtype": "float32", "head": "lm_head"}
    assert "STATEBLOCK_GREEDY_DTYPE" not in plan.env(plan.service("capture"), WIRING)


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        ({"STATEBLOCK_LEASES": "2"}, ValueError, "STATEBLOCK_LEASES is not a STATEBLOCK_"),
        ({"STATEBLOCK_NATS_URL": "nats://x:1"}, ValueError, "NATS_URL is not a setting the plan"),
        ({"STATEBLOCK_DATA_DIR": "/x"}, ValueError, "DATA_DIR is not a setting the plan"),
        ({"STATEBLOCK_WORKERS": "0"}, ConfigError, "STATEBLOCK_WORKERS=0 is below 1"),
        ({"STATEBLOCK_ACK_WAIT_S": "40"}, ConfigError, "must be at most half of"),
    ],
)
def test_a_plan_refuses_what_no_service_could_start_with(extra, error, message):
    with pytest.raises(error, match=message):
        _procs(extra_env=extra).plan()


def test_a_plan_refuses_a_topology_it_cannot_run():
    with pytest.raises(ValueError, match="in-process, a stack runs one capture and one"):
        StackPlan(Path("/d"), readout_procs=2)
    with pytest.raises(ValueError, match="in-process, a stack runs one capture and one"):
        StackPlan(Path("/d"), captures=2, ports=Ports(capture=(0, 0)))
    with pytest.raises(ValueError, match="one per process"):
        StackPlan(Path("/d"), PROCESSES, readout_procs=2, ports=Ports(readout_metrics=(1,)))
    with pytest.raises(ValueError, match="one per process"):
        StackPlan(Path("/d"), PROCESSES, captures=2)  # one capture port for two
    with pytest.raises(ValueError, match="placement"):
        StackPlan(Path("/d"), "kubernetes")


def test_a_process_runs_with_the_plans_settings_alone(tmp_path, monkeypatch):
    """The parent's STATEBLOCK_* variables do not leak into a service's process."""
    monkeypatch.setenv("STATEBLOCK_LEASE_S", "99")
    monkeypatch.setenv("SB_UNRELATED", "1")
    stack = ProcStack(_procs(data_dir=tmp_path))
    show = "import os; print(sorted(k for k in os.environ if k.startswith(('STATEBLOCK_', 'SB_'))))"
    stack._spawn("probe", [sys.executable, "-c", show], {"STATEBLOCK_WORKERS": "3"})
    assert stack._procs["probe"].wait(30) == 0
    assert (tmp_path / "probe.log").read_text().strip() == "['SB_UNRELATED', 'STATEBLOCK_WORKERS']"


def test_the_plan_carries_the_data_plane_and_refuses_local_rows_across_processes():
    """`stateblock up` keeps the rows in its process (local); a stack of processes keeps
    the bus, and a local plane it could never read is refused before anything starts."""
    plan = UpConfig(data_dir=Path("/d")).plan()
    for component in ("capture", "readout"):
        assert plan.config(plan.service(component), WIRING).data_plane == "local"
    bus = UpConfig(data_dir=Path("/d"), data_plane="bus").plan()
    assert bus.config(bus.service("capture"), WIRING).data_plane == "bus"
    procs = _procs().plan()
    assert procs.config(procs.service("readout"), WIRING).data_plane == "bus"
    with pytest.raises(ValueError, match="DATA_PLANE=local"):
        _procs(extra_env={"STATEBLOCK_DATA_PLANE": "local"}).plan()


@pytest.mark.parametrize("config", [CaptureConfig, ReadoutServiceConfig])
def test_an_unknown_data_plane_is_a_start_up_error(config):
    with pytest.raises(ConfigError, match="STATEBLOCK_DATA_PLANE='shm' must be"):
        config.from_env({"STATEBLOCK_DATA_PLANE": "shm"})


def test_up_takes_the_service_settings_of_its_environment_and_nothing_it_wires():
    """`stateblock up` gives its services the STATEBLOCK_* settings no flag of its covers;
    ports, keys, NATS logins and its own flags' variables are not among them."""
    from stateblock.app.stack import environment_settings

    environ = {
        "STATEBLOCK_CAPTURE_COHORT_TOKENS": "4096", "STATEBLOCK_GREEDY_DTYPE": "bfloat16",
        "STATEBLOCK_MAX_LANES": "", "STATEBLOCK_CAPTURE_PORT": "5", "STATEBLOCK_NATS_USER": "u",
        "STATEBLOCK_WORKERS": "7", "STATEBLOCK_KEY_DIR": "/k", "HOME": "/root",
    }  # fmt: skip
    chosen = environment_settings(environ)
    assert {s.name for s in chosen} == {
        "STATEBLOCK_CAPTURE_COHORT_TOKENS",
        "STATEBLOCK_GREEDY_DTYPE",
    }
    plan = UpConfig(data_dir=Path("/d"), workers=3, engine="torch", service_settings=chosen).check()
    capture = plan.config(plan.service("capture"), WIRING)
    readout = plan.config(plan.service("readout"), WIRING)
    assert capture.cohort_tokens == 4096 and capture.port == 0
    assert readout.engine_options() == {"greedy_dtype": "bfloat16"} and readout.workers == 3


def test_up_on_a_gpu_loads_bfloat16_and_the_torch_engine_unless_told_otherwise(monkeypatch):
    from stateblock.app import stack
    from stateblock.app.stack import environment_settings

    real = stack.resolve_device
    monkeypatch.setattr(stack, "resolve_device", lambda d: d if d == "cuda" else real(d))

    def dtype(**kw) -> str:
        plan = UpConfig(data_dir=Path("/d"), **kw).plan()
        return plan.config(plan.service("capture"), WIRING).dtype

    assert dtype() == "float32"  # UpConfig's device: the CPU
    assert dtype(device="cuda") == "bfloat16"
    chosen = environment_settings({"STATEBLOCK_CAPTURE_DTYPE": "float32"})
    assert dtype(device="cuda", service_settings=chosen) == "float32"
    auto = UpConfig(data_dir=Path("/d"), device="auto").plan()
    assert auto.value(settings.DEVICE) in ("cpu", "cuda")  # never "auto" past the plan

    def engine(device: str) -> str:
        plan = UpConfig(data_dir=Path("/d"), device=device, engine="auto").plan()
        return plan.config(plan.service("readout"), WIRING).engine

    assert (engine("cpu"), engine("cuda")) == ("reference", "torch")  # `up`'s engine auto
    plan = UpConfig(data_dir=Path("/d"), device="cuda", engine="onnx").plan()
    assert plan.value(settings.ENGINE) == "onnx"  # one named stays


def test_an_in_process_plan_is_the_environment_up_reads():
    plan = _procs(placement=IN_PROCESS, extra_env={"STATEBLOCK_CAPTURE_COHORT_LANES": "16"}).plan()
    env = plan.up_env()
    assert env["STATEBLOCK_CAPTURE_COHORT_LANES"] == "16" and env["STATEBLOCK_DEVICE"] == "cpu"
    assert not set(env) & {s.name for s in WIRING_SETTINGS}
    with pytest.raises(ValueError, match="in-process"):
        _procs().plan().up_env()
