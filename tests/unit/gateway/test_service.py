"""GatewayService's logic with a fake capture client and commit source: the request check
(gateway/params.py), lanes, the generation, errors, and stream pieces."""

from __future__ import annotations

import functools
import math
import threading

import pytest

import gateway.service
from gateway.errors import DeadlineExceeded, InvalidRequest, Unavailable
from gateway.params import GenerateParams, PromptSpec, check, make_sampling
from gateway.service import RECAPTURED
from registry import RegistryUnavailable
from stateblock.protocol.sampling import NO_EOS, SEED_LIMIT
from tests.unit.gateway.conftest import DEFAULT_MAX_TOKENS, MODEL


def params(**kw) -> GenerateParams:
    kw.setdefault("model", MODEL)
    kw.setdefault("inputs", (PromptSpec(prompt="copy: ab"),))
    return GenerateParams(**kw)


def request(**kw):
    """The request as an edge's conversion gives it to `generate`."""
    return functools.partial(check, params(**kw))


@pytest.mark.parametrize(
    ("p", "param"),
    [
        (params(model="other"), "model"),
        (params(inputs=()), "prompt"),
        (params(inputs=(PromptSpec(prompt=""),)), "prompt"),
        (params(inputs=(PromptSpec(messages=()),)), "messages"),
        (params(inputs=(PromptSpec(messages=(("user", ""),)),)), "messages"),
        (params(n=0), "n"),
        (params(n=5), "n"),  # over max_lanes=4
        (params(inputs=(PromptSpec(prompt="a"),) * 3, n=2), "n"),  # 6 lanes
        (params(max_tokens=0), "max_tokens"),
        (params(max_tokens=65), "max_tokens"),  # over the answer envelope of 64
        (params(sampling=make_sampling(2.5, None)), "temperature"),
        (params(sampling=make_sampling(-0.1, None)), "temperature"),
        (params(sampling=make_sampling(math.nan, None)), "temperature"),
    ],
)
def test_check_refuses_what_cannot_be_served(service, p, param):
    with pytest.raises(InvalidRequest) as e:
        check(p, service)
    assert e.value.param == param


def test_model_not_found_has_its_code(service):
    with pytest.raises(InvalidRequest) as e:
        check(params(model="gpt-4"), service)
    assert e.value.code == "model_not_found" and "gpt-4" in e.value.message


def test_check_resolves_the_depth_read(service):
    assert check(params(), service).max_tokens == DEFAULT_MAX_TOKENS
    assert check(params(max_tokens=64), service).max_tokens == 64


@pytest.mark.parametrize("seed", [-1, SEED_LIMIT])
def test_a_seed_the_wire_cannot_carry_is_refused(seed):
    with pytest.raises(InvalidRequest) as e:
        make_sampling(None, seed)
    assert e.value.param == "seed"


def test_lanes_are_n_per_input_with_consecutive_seeds(service):
    p = params(
        inputs=(PromptSpec(prompt="a"), PromptSpec(messages=(("user", "b"),))),
        n=2,
        sampling=make_sampling(0.7, SEED_LIMIT - 1, ignore_eos=True),
    )
    lanes = service.lanes(p, 9)
    assert [lane.WhichOneof("input") for lane in lanes] == ["prompt", "prompt", "chat", "chat"]
    assert [lane.sampling.seed for lane in lanes] == [SEED_LIMIT - 1, 0] * 2  # wraps
    assert all(lane.max_tokens == 9 and lane.sampling.ignore_eos for lane in lanes)
    assert all(math.isclose(lane.sampling.temperature, 0.7, rel_tol=1e-6) for lane in lanes)
    assert lanes[2].chat.messages[0].content == "b"


def test_unseeded_lanes_stay_unseeded(service):
    lanes = service.lanes(params(n=2), 4)
    assert not any(lane.sampling.HasField("seed") for lane in lanes)


async def test_generate_decodes_the_commit(service, fakes, detokenizer):
    capture, commits = fakes
    commits.answers = [[20, 21, 22], [23]]
    g = await service.generate(request(n=2, max_tokens=8), api="test")
    ((request_id, model, lanes),) = capture.calls
    assert g.request_id == request_id and model == MODEL and len(lanes) == 2
    assert [c.text for c in g.choices] == [
        detokenizer.decode([20, 21, 22]),
        detokenizer.decode([23]),
    ]
    assert [c.finish_reason for c in g.choices] == ["stop", "stop"]
    assert g.prompt_tokens == 3  # one input, counted once whatever n is
    assert g.completion_tokens == 4


async def test_a_long_answer_is_decoded_off_the_event_loop(service, fakes, monkeypatch):
    """An answer of OFF_LOOP_TOKENS or more is decoded on a thread (a maximal one takes tens
    of ms, which would hold up the loop's other requests), a short one on the loop; the
    texts are the same either way."""
    _, commits = fakes
    commits.answers = [[20, 21, 22], [23]]
    decode, threads = service.decode, []

    def spied(ids):
        threads.append(threading.get_ident())
        return decode(ids)

    monkeypatch.setattr(service, "decode", spied)
    short = await service.generate(request(n=2, max_tokens=8), api="test")
    assert threads and set(threads) == {threading.get_ident()}
    threads.clear()
    monkeypatch.setattr(gateway.service, "OFF_LOOP_TOKENS", 4)
    long = await service.generate(request(n=2, max_tokens=8), api="test")
    assert threads and threading.get_ident() not in threads
    assert [c.text for c in long.choices] == [c.text for c in short.choices]


async def test_no_eos_is_finish_reason_length(service, fakes):
    _, commits = fakes
    commits.eos = False
    (choice,) = (await service.generate(request(), api="test")).choices
    assert choice.finish_reason == "length" and choice.eos_pos == NO_EOS


async def test_no_commit_in_time_is_deadline_exceeded(service, fakes):
    _, commits = fakes
    commits.delay_s = 5.0  # the service's request timeout is 2 s
    with pytest.raises(DeadlineExceeded):
        await service.generate(request(), api="test", timeout=0.2)


async def test_a_registry_outage_is_unavailable(service, fakes):
    _, commits = fakes
    commits.error = RegistryUnavailable("nats down")
    with pytest.raises(Unavailable):
        await service.generate(request(), api="test")


async def test_invalid_requests_never_reach_the_capture(service, fakes):
    capture, _ = fakes
    with pytest.raises(InvalidRequest):
        await service.generate(request(max_tokens=1000), api="test")
    assert capture.calls == []


async def test_stream_pieces_concatenate_to_the_text(service, fakes):
    _, commits = fakes
    commits.answers = [list(range(5, 45)), [7]]
    g = await service.generate(request(n=2), api="test")
    for choice in g.choices:
        pieces = [p for p in service.pieces(g) if p.index == choice.index]
        assert "".join(p.text for p in pieces) == choice.text
        assert tuple(i for p in pieces for i in p.token_ids) == choice.token_ids
        assert [p.finish_reason for p in pieces][-1] == choice.finish_reason
        assert all(p.finish_reason is None for p in pieces[:-1])
    assert len([p for p in service.pieces(g) if p.index == 0]) == 3  # 40 ids, 16 a chunk


async def test_stream_pieces_wait_for_a_whole_character(service, fakes):
    class Bytes:
        """A byte-level tokenizer: ids are UTF-8 bytes."""

        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    service._tok = Bytes()
    _, commits = fakes
    text = "a" * 15 + "é" + "b" * 20  # é is 2 bytes: bytes 15 and 16, across the 16 boundary
    commits.answers = [list(text.encode())]
    g = await service.generate(request(), api="test")
    pieces = list(service.pieces(g))
    assert "".join(p.text for p in pieces) == text
    assert not any("\ufffd" in p.text for p in pieces)


def test_lost_rows_are_captured_again_and_rows_that_do_not_match_are_not():
    """A block whose rows are lost (its object, its slot, its region, or its time) is no
    fault of the request: it is captured again. Rows that do not match their signed digest
    are never a reason to run the request again."""
    assert {"object_missing", "expired", "rows_missing"} == RECAPTURED
