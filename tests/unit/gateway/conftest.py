"""The gateway through its seams: a fake capture client and a fake commit source stand in for
the capture service and the registry, so its logic and both transports run without NATS."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from gateway.capture_client import CaptureResult
from gateway.config import GatewayConfig
from gateway.detokenizer import Detokenizer
from gateway.metrics import GatewayMetrics
from gateway.service import GatewayService
from registry import CommitTimeout
from stateblock.protocol.sampling import NO_EOS, Limits
from stateblock.v1 import capture_pb2, commit_pb2
from tests.helpers import REFERENCE_BASE

MODEL = "test-model"
DEFAULT_MAX_TOKENS = 32


@dataclass
class FakeCapture:
    """Records each capture call; answers with a block id and 3 prompt tokens a lane."""

    calls: list[tuple[str, str, list[capture_pb2.CaptureLane]]] = field(default_factory=list)
    error: Exception | None = None

    async def capture(
        self, request: capture_pb2.CaptureRequest, *, timeout: float
    ) -> CaptureResult:
        if self.error is not None:
            raise self.error
        self.calls.append((request.request_id, request.model, list(request.lanes)))
        return CaptureResult(f"block-{len(self.calls)}", tuple(3 for _ in request.lanes))

    async def cancel(self, request_id: str, *, timeout: float) -> bool:
        return False  # every call here has run by the time a cancel could come


@dataclass
class FakeCommits:
    """Answers every block with the given lanes' token ids (EOS at the end unless ignored)."""

    answers: list[list[int]] = field(default_factory=lambda: [[20, 21, 22]])
    eos: bool = True
    error: Exception | None = None
    delay_s: float = 0.0

    async def watch_commit(self, block_id: str, timeout: float) -> commit_pb2.Commit:
        if self.delay_s:
            await asyncio.sleep(min(self.delay_s, timeout))
            if self.delay_s > timeout:
                raise CommitTimeout(block_id)
        if self.error is not None:
            raise self.error
        lanes = [
            commit_pb2.LaneAnswer(
                lane_index=i, token_ids=ids, eos_pos=len(ids) if self.eos else NO_EOS
            )
            for i, ids in enumerate(self.answers)
        ]
        for lane in lanes:  # log-probabilities as a worker writes them: one per position
            n = len(lane.token_ids) + 1  # the EOS position too
            lane.token_logprobs.extend(fake_logprob(j) for j in range(n))
            lane.top1_ids.extend([*lane.token_ids, 2])
            lane.top1_logprobs.extend(fake_logprob(j) for j in range(n))
            lane.top2_ids.extend(t + 1 for t in [*lane.token_ids, 2])
            lane.top2_logprobs.extend(fake_logprob(j) - 1 for j in range(n))
        return commit_pb2.Commit(block_id=block_id, lanes=lanes)


def fake_logprob(position: int) -> float:
    return -0.25 * (position + 1)


@pytest.fixture(scope="session")
def detokenizer() -> Detokenizer:
    return Detokenizer.load(REFERENCE_BASE)


@pytest.fixture
def fakes() -> tuple[FakeCapture, FakeCommits]:
    return FakeCapture(), FakeCommits()


@pytest.fixture
def metrics() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def service(fakes, detokenizer, metrics) -> GatewayService:
    capture, commits = fakes
    config = GatewayConfig(
        model_name=MODEL, limits=Limits(max_lanes=4, answer_depth_max=64), request_timeout_s=2.0
    )
    return GatewayService(
        capture,
        commits,
        detokenizer,
        GatewayMetrics(metrics, MODEL),
        config=config,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        fingerprint="fp_test",
    )
