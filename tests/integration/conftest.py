"""Service-test fixtures: a small random decoder bound to the shipped base model.

The shipped decoder is trained separately; these tests need one that matches the shipped
base (its manifest checks pass) and is cheap on a CPU, not one that answers well.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import structlog
import torch

from stateblock.app.stack import StackThread, UpConfig
from stateblock.model.capture import lm_head_weight
from stateblock.model.checkpoint import (
    base_model_digest,
    save_decoder,
    tensor_digest,
    tokenizer_digest,
)
from stateblock.model.decoder import ReadoutConfig, ReadoutDecoder
from stateblock.model.loading import load_base
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import DEFAULT_MODEL_NAME, REFERENCE_BASE

TEST_MAX_ANSWER = 4096

# The readout key of the tests that assemble services by hand: workers sign with it, the
# gateway trusts it (the embedded stack makes its own under its data dir).
READOUT_SIGNER = Signer.generate()
READOUT_TRUST = TrustStore([READOUT_SIGNER.public_key])


def build_test_decoder(out_dir: Path, base_dir: Path = REFERENCE_BASE, seed: int = 0) -> Path:
    model, tok = load_base(base_dir)
    lm_head = lm_head_weight(model)
    torch.manual_seed(seed)
    decoder = ReadoutDecoder(
        ReadoutConfig(
            d_base=model.config.hidden_size,
            vocab_size=lm_head.shape[0],
            eos_token_id=tok.eos_token_id,
            d_r=64,
            n_latent=8,
            n_heads=4,
        )
    )
    identity = {
        "base_model_digest": base_model_digest(base_dir),
        "tokenizer_digest": tokenizer_digest(base_dir),
        "lm_head_digest": tensor_digest(lm_head),
        "data_digest": "test",
    }
    save_decoder(
        out_dir, decoder, identity, {"training": {"config": {"max_answer": TEST_MAX_ANSWER}}}
    )
    return out_dir


@pytest.fixture(scope="session", autouse=True)
def quiet_service_logs() -> None:
    """Warnings and errors only: the stack's threads log outside pytest's capture."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


@pytest.fixture(scope="session")
def decoder_dir(tmp_path_factory) -> Path:
    torch.set_num_threads(1)  # the services' forwards and readouts share a small CPU
    return build_test_decoder(tmp_path_factory.mktemp("decoder"))


@pytest.fixture(scope="session")
def serving_model(decoder_dir):
    from stateblock.model.loading import load_serving_model

    return load_serving_model(DEFAULT_MODEL_NAME, REFERENCE_BASE, decoder_dir)


@pytest.fixture(scope="session")
def engine(serving_model):
    from stateblock.engines import create_engine

    return create_engine("reference", serving_model)


@pytest.fixture(scope="module")
def stack(decoder_dir, tmp_path_factory) -> Iterator[StackThread]:
    config = UpConfig(
        data_dir=tmp_path_factory.mktemp("stack"),
        http_port=0,
        grpc_port=0,
        workers=2,
        decoder_dir=decoder_dir,
        request_timeout_s=30.0,
        data_plane="bus",  # the portable path; test_local_data_plane runs `up`'s default
    )
    runner = StackThread(config)
    runner.start()
    yield runner
    runner.stop()


@pytest.fixture
async def nc(nats_url):
    """A client of the test's own nats-server (test_determinism uses the stack's)."""
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()
