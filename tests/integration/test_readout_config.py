"""The readout service's settings: its engine (an unknown one fails closed), the blocks
stream's storage, the torch engine's options, and the pull loops and cohorts a process
runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from prometheus_client import CollectorRegistry

from readout_svc.config import ReadoutServiceConfig
from readout_svc.server import running_readout
from stateblock.engines import UnknownEngine, UnservedDecoder, create_engine
from stateblock.protocol.keys import Signer, TrustStore
from stateblock.runtime import ConfigError
from tests.integration.conftest import READOUT_SIGNER

SIGNER = Signer.generate()


def test_unknown_engine_fails_closed(serving_model):
    with pytest.raises(UnknownEngine, match="unknown readout engine 'tensorrt-fast'"):
        create_engine("tensorrt-fast", serving_model)


@pytest.mark.parametrize("name", ["onnx", "torch"])
@pytest.mark.parametrize("reads", [{"copy": "twin"}, {"row_tokens": True}])
def test_a_decoder_that_reads_token_ids_is_refused_by_the_fast_engines(serving_model, name, reads):
    """A copy head or row tokens read the prompt's token ids: the reference engine serves
    them (tests/integration/test_prose_pair.py), an engine that takes rows alone stops the
    worker at start-up with the reason, never at a request."""
    manifest = {**serving_model.manifest}
    manifest["decoder_config"] = {**manifest["decoder_config"], **reads}
    copying = dataclasses.replace(serving_model, manifest=manifest)
    assert copying.reads_prompt_ids and not serving_model.reads_prompt_ids
    with pytest.raises(UnservedDecoder, match=f"token ids .* engine '{name}' does not serve"):
        create_engine(name, copying, "cpu")


@pytest.mark.parametrize("name", ["reference", "torch"])
def test_a_decoder_that_reads_the_bases_attention_maps_is_refused(serving_model, name):
    """copy_point: the blocks carry no attention maps, so every engine refuses at start-up."""
    manifest = {**serving_model.manifest}
    manifest["decoder_config"] = {**manifest["decoder_config"], "copy": "twin", "copy_point": 36}
    pointing = dataclasses.replace(serving_model, manifest=manifest)
    with pytest.raises(UnservedDecoder, match="36 of the base's attention maps"):
        create_engine(name, pointing, "cpu")


def test_blocks_storage_from_env():
    env = {"STATEBLOCK_BLOCKS_STORAGE": "memory"}
    assert ReadoutServiceConfig.from_env(env).blocks_storage == "memory"
    assert ReadoutServiceConfig.from_env({}).blocks_storage == "file"
    with pytest.raises(ConfigError, match="STATEBLOCK_BLOCKS_STORAGE='Memory'"):
        ReadoutServiceConfig.from_env({"STATEBLOCK_BLOCKS_STORAGE": "Memory"})


def test_torch_engine_settings_from_env(serving_model):
    """STATEBLOCK_MATMUL_PRECISION / _READOUT_HEAD / _GREEDY_DTYPE reach the torch engine, fail
    closed on a bad value or on another engine, and the factory refuses unknown settings."""
    env = {"STATEBLOCK_ENGINE": "torch", "STATEBLOCK_MATMUL_PRECISION": "high",
           "STATEBLOCK_READOUT_HEAD": "fused", "STATEBLOCK_GREEDY_DTYPE": "bfloat16"}  # fmt: skip
    config = ReadoutServiceConfig.from_env(env)
    assert config.engine_options() == {
        "matmul_precision": "high", "head": "fused", "greedy_dtype": "bfloat16"
    }  # fmt: skip
    assert ReadoutServiceConfig.from_env({"STATEBLOCK_ENGINE": "torch"}).engine_options() == {}
    # the torch engine is created with the request limits, which its warm-up records up to
    limited = {**env, "STATEBLOCK_PROMPT_LEN_MAX": "1000", "STATEBLOCK_ANSWER_DEPTH_MAX": "300"}
    kwargs = ReadoutServiceConfig.from_env(limited).engine_kwargs()
    assert kwargs == {**config.engine_options(), "warm_up_to": (1000, 300)}
    assert "warm_up_to" not in ReadoutServiceConfig.from_env({}).engine_kwargs()  # reference
    with pytest.raises(ConfigError, match="MATMUL_PRECISION"):
        ReadoutServiceConfig.from_env({**env, "STATEBLOCK_MATMUL_PRECISION": "medium"})
    with pytest.raises(ConfigError, match="READOUT_HEAD"):
        ReadoutServiceConfig.from_env({**env, "STATEBLOCK_READOUT_HEAD": "logits"})
    with pytest.raises(ConfigError, match="GREEDY_DTYPE"):
        ReadoutServiceConfig.from_env({**env, "STATEBLOCK_GREEDY_DTYPE": "int8"})
    with pytest.raises(ConfigError, match="GREEDY_DTYPE"):  # its norms overflow fp16
        ReadoutServiceConfig.from_env({**env, "STATEBLOCK_GREEDY_DTYPE": "float16"})
    with pytest.raises(ConfigError, match="ENGINE=torch only"):
        ReadoutServiceConfig.from_env({**env, "STATEBLOCK_ENGINE": "reference"})
    # the CPU engine takes them (its numerics stay the reference's) ...
    eng = create_engine("torch", serving_model, "cpu", **config.engine_kwargs())
    assert eng.head == "fused" and eng._greedy[1].dtype == torch.bfloat16
    # ... and no engine takes a setting it does not know
    with pytest.raises(ValueError, match="takes no setting"):
        create_engine("reference", serving_model, "cpu", head="fused")


async def test_unknown_engine_refuses_to_start_the_service(monkeypatch):
    from readout_svc.server import main

    monkeypatch.setenv("STATEBLOCK_ENGINE", "nope")
    with pytest.raises(UnknownEngine):
        await main()


@pytest.mark.parametrize(
    ("engine_name", "env", "loops"),
    [
        ("reference", {}, 2),  # reads every block alone: two at a time
        ("torch", {}, 16),  # combines blocks: two executions of 8 lanes in hand
        ("torch", {"STATEBLOCK_READOUT_COHORT_LANES": "4"}, 8),
        ("torch", {"STATEBLOCK_READOUT_COHORT_LANES": "1"}, 2),  # combining off
        ("torch", {"STATEBLOCK_WORKERS": "3"}, 3),  # a set value wins
    ],
)
async def test_the_pull_loops_follow_the_engine_unless_set(
    nc, serving_model, engine_name, env, loops
):
    """A process combines only the blocks its pull loops hold: by default an engine that
    combines gets enough of them to fill the two executions it runs at once."""
    config = ReadoutServiceConfig.from_env(
        {"STATEBLOCK_NATS_URL": "unused", "STATEBLOCK_FETCH_TIMEOUT_S": "0.2", **env}
    )
    engine = create_engine(engine_name, serving_model, "cpu")
    async with running_readout(
        config, nc=nc, engine=engine, trust=TrustStore([SIGNER.public_key]),
        signer=READOUT_SIGNER, metrics=CollectorRegistry(),
    ) as running:  # fmt: skip
        assert len(running.workers) == loops


def test_workers_below_one_are_refused():
    for raw in ("0", "-1"):
        with pytest.raises(ConfigError, match=f"STATEBLOCK_WORKERS={raw} is below 1"):
            ReadoutServiceConfig.from_env({"STATEBLOCK_WORKERS": raw})


def test_overlap_lanes_default_to_the_cohort_bound():
    """STATEBLOCK_READOUT_OVERLAP_LANES: unset, a cohort starts beside a running execution
    only when full (readout_svc.cohorts); set, at that many lanes; below 1, refused."""
    assert ReadoutServiceConfig.from_env({}).overlap_lanes is None
    env = {"STATEBLOCK_READOUT_OVERLAP_LANES": "1"}
    assert ReadoutServiceConfig.from_env(env).overlap_lanes == 1
    with pytest.raises(ConfigError, match="STATEBLOCK_READOUT_OVERLAP_LANES=0 is below 1"):
        ReadoutServiceConfig.from_env({"STATEBLOCK_READOUT_OVERLAP_LANES": "0"})
