"""The records a readout worker signs into the registry: a commit (the answer, with the digest
the determinism gate compares) or a rejection (a verified block's end without one)."""

from __future__ import annotations

import hashlib

from google.protobuf.timestamp_pb2 import Timestamp

from stateblock.engines import LaneResult
from stateblock.protocol import outcomes
from stateblock.protocol.keys import Signer
from stateblock.v1 import block_pb2 as block_pb
from stateblock.v1 import commit_pb2 as pb


def output_digest(lanes: list[pb.LaneAnswer]) -> bytes:
    """SHA-256 over the answer only (token ids and EOS positions), deterministic."""
    answer = pb.Commit(
        lanes=[
            pb.LaneAnswer(lane_index=a.lane_index, token_ids=a.token_ids, eos_pos=a.eos_pos)
            for a in lanes
        ]
    )
    return hashlib.sha256(answer.SerializeToString(deterministic=True)).digest()


def commit_record(
    header: block_pb.StateBlockHeader, results: list[LaneResult], worker_id: str
) -> pb.Commit:
    lanes = [
        pb.LaneAnswer(
            lane_index=i, token_ids=r.token_ids, eos_pos=r.eos_pos, top2_margins=r.margins
        )
        for i, r in enumerate(results)
    ]
    for lane, r in zip(lanes, results, strict=True):
        if r.logprobs is not None:  # asked for: SamplingParams.logprobs
            lane.token_logprobs.extend(r.logprobs.token)
            lane.top1_ids.extend(r.logprobs.top1_ids)
            lane.top1_logprobs.extend(r.logprobs.top1)
            lane.top2_ids.extend(r.logprobs.top2_ids)
            lane.top2_logprobs.extend(r.logprobs.top2)
    now = Timestamp()
    now.GetCurrentTime()
    return pb.Commit(
        block_id=header.block_id,
        request_id=header.request_id,
        lanes=lanes,
        output_digest=output_digest(lanes),
        forward_state_digest=header.forward_state_digest,
        forward_state_algorithm=header.forward_state_algorithm,
        worker_id=worker_id,
        committed_at=now,
    )


def rejection_record(
    header: block_pb.StateBlockHeader, reason: str, detail: str, worker_id: str, signer: Signer
) -> pb.Rejection:
    """A verified block's end without an answer, signed by this readout's key."""
    now = Timestamp()
    now.GetCurrentTime()
    rejection = pb.Rejection(
        block_id=header.block_id,
        request_id=header.request_id,
        reason=reason,
        detail=detail[:500],
        worker_id=worker_id,
        rejected_at=now,
    )
    outcomes.sign(rejection, signer)
    return rejection
