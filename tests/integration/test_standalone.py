"""The three services as separate processes (`python -m capture_svc` / `readout_svc` /
`gateway`), configured only through STATEBLOCK_* variables, against a real nats-server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from stateblock.app.nats_server import free_port
from stateblock.protocol.keys import generate_keypair
from stateblock.protocol.tokens import load_or_generate_token
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from stateblock.runtime import REFERENCE_BASE, REPO
from tests.integration.test_request_path import in_process_answer

READY_TIMEOUT_S = 60.0
GRACE_S = 5.0
EXIT_HEADROOM_S = 10.0  # beyond the grace period: nc.drain() and interpreter exit
PROMPT = "copy: hello"
MAX_TOKENS = 24
SERVICES = ("capture_svc", "readout_svc", "gateway")
# The log line each service writes once it is serving (see each server.py).
READY_LINES = {
    "capture_svc": "capture service listening",
    "readout_svc": "readout workers running",
    "gateway": "gateway listening",
}


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""


def _start(name: str, env: dict[str, str], log_dir: Path) -> Service:
    stderr_path = log_dir / f"{name}.stderr"
    with stderr_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", name],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=subprocess.STDOUT,
        )
    return Service(name, proc, stderr_path)


def _dump(services: list[Service]) -> str:
    return "\n".join(
        f"--- {s.name} (rc={s.proc.poll()}) ---\n{s.stderr()[-4000:]}" for s in services
    )


def _wait_ready(services: list[Service], health_url: str) -> None:
    """Each service has logged its ready line and the gateway answers /health."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for s in services:
            if s.proc.poll() is not None:
                pytest.fail(f"{s.name} exited with {s.proc.returncode}\n{_dump(services)}")
        if all(READY_LINES[s.name] in s.stderr() for s in services):
            try:
                if httpx.get(health_url, timeout=2.0).json().get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
        time.sleep(0.25)
    pytest.fail(f"services not ready in {READY_TIMEOUT_S}s\n{_dump(services)}")


@pytest.fixture
def standalone_env(start_nats_server, decoder_dir, tmp_path) -> dict[str, str]:
    nats = start_nats_server()
    keys = generate_keypair(tmp_path / "keys")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / keys.public_path.name).write_bytes(keys.public_path.read_bytes())
    readout_keys = generate_keypair(tmp_path / "readout-keys")  # the gateway must know it
    token_file = tmp_path / "capture-token"  # the gateway's credential at the capture
    load_or_generate_token(token_file)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATEBLOCK_")}
    env.update(
        OMP_NUM_THREADS="1",  # the services share a small, busy CPU
        PYTHONUNBUFFERED="1",
        STATEBLOCK_NATS_URL=nats.url,
        STATEBLOCK_BASE_DIR=str(REFERENCE_BASE),
        STATEBLOCK_DECODER_DIR=str(decoder_dir),
        STATEBLOCK_DEVICE="cpu",
        STATEBLOCK_KEY_DIR=str(keys.private_path.parent),
        STATEBLOCK_TRUSTED_KEYS_DIR=str(trusted),
        STATEBLOCK_READOUT_KEY_DIR=str(readout_keys.private_path.parent),
        STATEBLOCK_READOUT_TRUSTED_KEYS_DIR=str(readout_keys.private_path.parent),
        STATEBLOCK_CAPTURE_HOST="127.0.0.1",
        STATEBLOCK_CAPTURE_TOKEN_FILE=str(token_file),
        STATEBLOCK_CAPTURE_PORT=str(free_port()),
        STATEBLOCK_GATEWAY_HOST="127.0.0.1",
        STATEBLOCK_HTTP_PORT=str(free_port()),
        STATEBLOCK_GRPC_PORT=str(free_port()),
        STATEBLOCK_WORKERS="1",
        STATEBLOCK_REQUEST_TIMEOUT_S="60",
        STATEBLOCK_GRACE_S=str(GRACE_S),
        STATEBLOCK_LOG_LEVEL="info",
    )
    env["STATEBLOCK_CAPTURE_TARGET"] = f"127.0.0.1:{env['STATEBLOCK_CAPTURE_PORT']}"
    return env


@pytest.fixture
def services(standalone_env, tmp_path) -> Iterator[list[Service]]:
    started: list[Service] = []
    try:
        for name in SERVICES:
            started.append(_start(name, standalone_env, tmp_path))
        yield started
    finally:
        for s in started:  # a no-op for those the test already stopped
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait(10)


def test_standalone_services_answer_and_stop_cleanly(
    services, standalone_env, serving_model, engine
):
    http = f"http://127.0.0.1:{standalone_env['STATEBLOCK_HTTP_PORT']}"
    _wait_ready(services, f"{http}/health")

    client = openai.OpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=90)
    try:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS)
    except openai.OpenAIError as e:
        pytest.fail(f"request failed: {e!r}\n{_dump(services)}")
    expected = in_process_answer(serving_model, engine, PROMPT, MAX_TOKENS)
    want = serving_model.tokenizer.decode(expected, skip_special_tokens=True)
    assert r.choices[0].text == want, _dump(services)

    # Gateway first (stop taking requests), then the services behind it.
    for s in reversed(services):
        s.proc.send_signal(signal.SIGTERM)
    for s in reversed(services):
        try:
            rc = s.proc.wait(GRACE_S + EXIT_HEADROOM_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{s.name} did not exit after SIGTERM\n{_dump(services)}")
        assert rc == 0, f"{s.name} exited with {rc}\n{_dump(services)}"


@pytest.mark.parametrize(
    ("engine", "says"),
    [("onnx", "stateblock export"), ("tensorrt-llm", "unknown readout engine")],
    ids=["onnx-without-its-graph", "unknown-engine"],
)
def test_readout_service_fails_closed_at_start_up(standalone_env, tmp_path, engine, says):
    """An engine that cannot load stops the worker process before it consumes a block: no
    fallback to another engine, a non-zero exit and the reason on stderr."""
    env = {**standalone_env, "STATEBLOCK_ENGINE": engine}  # the test decoder has no graph
    service = _start("readout_svc", env, tmp_path)
    try:
        rc = service.proc.wait(READY_TIMEOUT_S)
    finally:
        if service.proc.poll() is None:
            service.proc.kill()
    assert rc != 0, service.stderr()
    assert says in service.stderr()
    assert READY_LINES["readout_svc"] not in service.stderr()


def test_up_ask_stops_when_its_reader_goes_away(tmp_path):
    """`stateblock up --ask ... | head -5`: the reader takes the banner and closes the pipe
    before the answer is printed; the embedded stack must still stop instead of running on
    unattended."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "stateblock.app.cli", "up", "--ask", PROMPT,
         "--data-dir", str(tmp_path / "up"), "--http-port", str(free_port()),
         "--grpc-port", str(free_port())],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        banner = [proc.stdout.readline() for _ in range(5)]  # up, HTTP, gRPC, metrics, NATS
        assert banner[0].startswith(b"stateblock is up") and b"NATS" in banner[4], banner
        proc.stdout.close()  # `head -5` is done
        rc = proc.wait(timeout=READY_TIMEOUT_S)
    finally:
        if proc.poll() is None:  # hung: Ctrl-C first, so it stops its nats-server too
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=GRACE_S + EXIT_HEADROOM_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert rc != 0  # the ask could not print its answer: a failed ask, not a hang
