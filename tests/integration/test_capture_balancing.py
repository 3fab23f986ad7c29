"""More than one capture replica: the gateway balances round-robin over every address its
capture target resolves to (in Kubernetes, a headless Service's pods)."""

from __future__ import annotations

import httpx
import nats
from prometheus_client import CollectorRegistry

from capture_svc.config import CaptureConfig
from capture_svc.server import running_capture
from gateway.server import running_gateway
from readout_svc.config import ReadoutServiceConfig
from readout_svc.server import running_readout
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME as MODEL
from tests.integration.conftest import READOUT_SIGNER, READOUT_TRUST
from tests.integration.test_gateway_errors import gateway_config

PLANS = "stateblock_capture_plans_registered_total"


async def test_gateway_spreads_requests_over_capture_replicas(
    nats_url, decoder_dir, serving_model, engine
):
    nc = await nats.connect(nats_url)
    signer = Signer.generate()
    metrics = [CollectorRegistry(), CollectorRegistry()]
    readout_config = ReadoutServiceConfig(nats_url="unused", workers=1, fetch_timeout_s=0.2)
    try:
        async with (
            running_capture(
                CaptureConfig(port=0, host="127.0.0.1"),
                nc=nc, model=serving_model, signer=signer, metrics=metrics[0],
            ) as first,
            running_capture(
                CaptureConfig(port=0, host="127.0.0.1"),
                nc=nc, model=serving_model, signer=signer, metrics=metrics[1],
            ) as second,
            running_readout(
                readout_config, nc=nc, engine=engine, trust=TrustStore([signer.public_key]), signer=READOUT_SIGNER,
                metrics=CollectorRegistry(),
            ),
            running_gateway(
                gateway_config(decoder_dir, f"ipv4:127.0.0.1:{first.port},127.0.0.1:{second.port}"),
                nc=nc, metrics=CollectorRegistry(), tokenizer=serving_model.tokenizer, readout_trust=READOUT_TRUST,
            ) as gw,
        ):  # fmt: skip
            body = {"model": MODEL, "prompt": "copy: ab", "max_tokens": 4}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as http:
                for _ in range(8):  # one at a time: the two replicas share one model here
                    r = await http.post("/v1/completions", json=body, timeout=30)
                    assert r.status_code == 200, r.text
    finally:
        await nc.close()
    served = [m.get_sample_value(PLANS) or 0.0 for m in metrics]
    assert sum(served) == 8 and min(served) >= 2, served
