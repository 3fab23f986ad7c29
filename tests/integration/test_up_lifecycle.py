"""`stateblock up` as a user runs it, in a subprocess: Ctrl-C (SIGINT to the whole process
group, as a terminal sends it) and SIGTERM stop it cleanly with exit 0; every start-up
failure is one clear line, a non-zero exit, and no process left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stateblock.app.nats_server import free_port
from tests.helpers import REPO

READY_S = 120.0


def nats_servers_of(data_dir: Path) -> list[int]:
    """Pids of nats-servers whose config lies under data_dir (none may outlive `up`)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "nats-server" in cmdline and str(data_dir) in cmdline:
            pids.append(int(proc.name))
    return pids


def up(data_dir: Path, *args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    # SIGABRT dumps every thread's stack
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "stateblock.app.cli", "up", "--data-dir", str(data_dir), *args],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, env=env, **popen,
    )  # fmt: skip


def exit_of(proc: subprocess.Popen) -> tuple[int, str]:
    """The exit status and stderr of an `up` that should end by itself, its pipes read
    meanwhile (a full pipe would block it); one that does not end within READY_S fails the
    test with every thread's stack (faulthandler) and its last output."""
    try:
        _, err = proc.communicate(timeout=READY_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # its nats-server, if left
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"stateblock up did not exit:\n{err.decode(errors='replace')[-6000:]}")
    return proc.returncode, err.decode()


def wait_ready(proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"up exited: {proc.wait()} {proc.stderr.read()[-2000:]}")
        if b"(Ctrl-C stops)" in line:
            return
    raise TimeoutError("stateblock up not ready")


@pytest.mark.parametrize(
    "stop",
    [lambda p: os.killpg(p.pid, signal.SIGINT), lambda p: p.send_signal(signal.SIGTERM)],
    ids=["ctrl_c_to_the_process_group", "sigterm"],
)
def test_up_stops_cleanly_and_leaves_nothing_running(tmp_path, stop):
    data = tmp_path / "up"
    proc = up(data, "--http-port", "0", "--grpc-port", "0")
    try:
        wait_ready(proc)
        assert len(nats_servers_of(data)) == 1
        stop(proc)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    assert rc == 0, err[-2000:]
    assert "stateblock stopped" in out and "Traceback" not in err, err[-2000:]
    assert nats_servers_of(data) == []


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("which", ["--http-port", "--grpc-port"])
def test_a_port_in_use_is_one_line_and_nothing_left(tmp_path, which):
    data = tmp_path / "up"
    with _busy_port() as busy:
        port = str(busy.getsockname()[1])
        other = "--grpc-port" if which == "--http-port" else "--http-port"
        proc = up(data, which, port, other, str(free_port()))
        rc, err = exit_of(proc)
    assert rc != 0
    (line,) = [x for x in err.splitlines() if x.startswith("stateblock up:")]
    assert "cannot listen" in line and port in line
    assert "Traceback" not in err
    assert nats_servers_of(data) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nats-url", "nats://127.0.0.1:1"], "no NATS server reachable"),
        (["--base", "/nonexistent/base"], "/nonexistent/base"),
    ],
)
def test_a_bad_setting_is_one_line_and_nothing_left(tmp_path, args, says):
    data = tmp_path / "up"
    proc = up(data, "--http-port", "0", "--grpc-port", "0", *args)
    rc, err = exit_of(proc)
    assert rc != 0 and "Traceback" not in err, err[-2000:]
    (line,) = [x for x in err.splitlines() if x.startswith("stateblock up:")]
    assert says in line
    assert nats_servers_of(data) == []


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"STATEBLOCK_MAX_LANES": "0"}, "STATEBLOCK_MAX_LANES"),
        ({"STATEBLOCK_LEASE_S": "30", "STATEBLOCK_ACK_WAIT_S": "20"}, "STATEBLOCK_ACK_WAIT_S"),
        ({"STATEBLOCK_DEVICE": "tpu"}, "STATEBLOCK_DEVICE='tpu' must be"),
        ({"STATEBLOCK_DEVICE": "cuda:99"}, "no such CUDA device"),
    ],
    ids=["unreadable", "inconsistent", "unknown_device", "absent_device"],
)
def test_a_bad_service_variable_stops_up_before_it_starts(tmp_path, env, says):
    """A STATEBLOCK_* setting no flag covers goes to the services that read it; one they could
    not start with is exit 2 and one line naming it, before nats-server or a model load."""
    data = tmp_path / "up"
    proc = up(data, "--http-port", "0", "--grpc-port", "0", env=env)
    rc, err = exit_of(proc)
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    (line,) = [x for x in err.splitlines() if x.startswith("stateblock up:")]
    assert says in line
    assert nats_servers_of(data) == [] and not (data / "nats").exists()


def url_of(proc: subprocess.Popen) -> str:
    """The OpenAI base URL `up` prints once it is ready."""
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if not line:
            break
        if "OpenAI HTTP API" in line:
            return line.split()[-1]
    raise AssertionError(f"up not ready: {proc.stderr.read().decode()[-2000:]}")


def test_up_gives_its_services_the_settings_of_the_environment(tmp_path):
    """`STATEBLOCK_MAX_LANES=1 stateblock up`: the gateway `up` runs holds requests to one
    lane (the default is 8), as its own process would under that variable."""
    import openai

    proc = up(
        tmp_path / "up", "--http-port", str(free_port()), "--grpc-port", "0",
        env={"STATEBLOCK_MAX_LANES": "1"},
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=url_of(proc), api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        one = client.completions.create(model=model, prompt="copy: ab", max_tokens=4)
        assert len(one.choices) == 1
        with pytest.raises(openai.BadRequestError, match="lanes|n ") as e:
            client.completions.create(model=model, prompt="copy: ab", max_tokens=4, n=2)
        assert e.value.status_code == 400
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_up_serves_a_hugging_face_style_model_name(tmp_path):
    """`--model-name org/model-v2.1` (a '/' and a '.'): served under that name end to end."""
    import json
    import urllib.request

    proc = up(
        tmp_path / "up", "--http-port", str(free_port()), "--grpc-port", "0",
        "--model-name", "org/model-v2.1",
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = None
        deadline = time.monotonic() + READY_S
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            if "OpenAI HTTP API" in line:
                url = line.split()[-1]
        assert url, proc.stderr.read().decode()[-2000:]
        with urllib.request.urlopen(f"{url}/models", timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == "org/model-v2.1"
        body = json.dumps({"model": "org/model-v2.1", "prompt": "copy: ab", "max_tokens": 4})
        req = urllib.request.Request(
            f"{url}/completions", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["model"] == "org/model-v2.1"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
