"""`stateblock up` supervises the nats-server it started: one killed (SIGKILL) comes back on
the same port and store, so requests are answered again and committed answers are still
served; one that cannot come back ends `up` with a non-zero exit and one line."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stateblock.app.stack import StackThread, UpConfig
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from tests.integration.test_up_lifecycle import READY_S, nats_servers_of, up, wait_ready

BACK_WITHIN_S = 5.0  # issue 39: requests succeed again this soon after the kill


def plans(http_url: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{http_url}/metrics").text):
        for sample in family.samples:
            if sample.name == "stateblock_capture_plans_registered_total":
                return sample.value
    raise AssertionError("no plan counter")


def kill_nats(data_dir) -> int:
    (pid,) = nats_servers_of(data_dir)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid in nats_servers_of(data_dir) and time.monotonic() < deadline:
        time.sleep(0.01)  # gone from /proc once reaped by the stack
    return pid


@pytest.fixture
def own_stack(decoder_dir, tmp_path):
    config = UpConfig(
        data_dir=tmp_path / "stack",
        http_port=0,
        grpc_port=0,
        workers=1,
        decoder_dir=decoder_dir,
        request_timeout_s=30.0,
    )
    runner = StackThread(config)
    runner.start(timeout=READY_S)
    try:
        yield runner
    finally:
        runner.stop()
    assert nats_servers_of(config.data_dir) == []  # the restarted server stopped with it


def test_a_killed_nats_server_is_restarted_on_its_store_and_port(own_stack):
    url, data = own_stack.urls.http, own_stack.config.data_dir
    body = {"model": MODEL, "prompt": "copy: kept", "max_tokens": 6, "temperature": 1.0}
    keyed = {"Idempotency-Key": "before-the-kill"}
    first = httpx.post(f"{url}/v1/completions", json=body, headers=keyed, timeout=30)
    assert first.status_code == 200, first.text
    captured = plans(url)
    killed = kill_nats(data)
    t0 = time.monotonic()
    answered = None
    while answered is None and time.monotonic() - t0 < 30:
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": "copy: back", "max_tokens": 4},
            timeout=30,
        )
        if r.status_code == 200:
            answered = time.monotonic() - t0
        else:
            assert r.status_code == 503, r.text  # unavailable while it restarts, nothing else
            time.sleep(0.1)
    assert answered is not None and answered <= BACK_WITHIN_S, answered
    (pid,) = nats_servers_of(data)
    assert pid != killed
    again = httpx.post(f"{url}/v1/completions", json=body, headers=keyed, timeout=30)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]  # the key's first answer, from the store
    assert again.json()["choices"] == first.json()["choices"]
    assert plans(url) == captured + 1  # "copy: back" alone was captured after the kill


def test_a_nats_server_that_cannot_restart_ends_up_with_one_line(tmp_path):
    data = tmp_path / "up"
    proc = up(data, "--http-port", "0", "--grpc-port", "0")
    try:
        wait_ready(proc)
        (data / "nats.conf").write_text("listen: {{ this is no config\n")  # every restart fails
        kill_nats(data)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().decode()
    assert rc != 0 and "Traceback" not in err, err[-2000:]
    (line,) = [x for x in err.splitlines() if x.startswith("stateblock up:")]
    assert "nats-server" in line and "restart" in line and str(data) in line, line
    assert nats_servers_of(data) == []
