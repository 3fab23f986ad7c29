import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from stateblock.v1 import block_pb2 as _block_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClaimState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLAIM_STATE_UNSPECIFIED: _ClassVar[ClaimState]
    CLAIM_STATE_CLAIMED: _ClassVar[ClaimState]
    CLAIM_STATE_COMMITTED: _ClassVar[ClaimState]
    CLAIM_STATE_REJECTED: _ClassVar[ClaimState]
CLAIM_STATE_UNSPECIFIED: ClaimState
CLAIM_STATE_CLAIMED: ClaimState
CLAIM_STATE_COMMITTED: ClaimState
CLAIM_STATE_REJECTED: ClaimState

class LaneAnswer(_message.Message):
    __slots__ = ("lane_index", "token_ids", "eos_pos", "top2_margins", "token_logprobs", "top1_ids", "top1_logprobs", "top2_ids", "top2_logprobs")
    LANE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EOS_POS_FIELD_NUMBER: _ClassVar[int]
    TOP2_MARGINS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP1_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP1_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP2_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP2_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    lane_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    eos_pos: int
    top2_margins: _containers.RepeatedScalarFieldContainer[float]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top1_ids: _containers.RepeatedScalarFieldContainer[int]
    top1_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top2_ids: _containers.RepeatedScalarFieldContainer[int]
    top2_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, lane_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., eos_pos: _Optional[int] = ..., top2_margins: _Optional[_Iterable[float]] = ..., token_logprobs: _Optional[_Iterable[float]] = ..., top1_ids: _Optional[_Iterable[int]] = ..., top1_logprobs: _Optional[_Iterable[float]] = ..., top2_ids: _Optional[_Iterable[int]] = ..., top2_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("block_id", "request_id", "lanes", "output_digest", "forward_state_digest", "worker_id", "committed_at", "key_id", "signature", "forward_state_algorithm")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FORWARD_STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_STATE_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    request_id: str
    lanes: _containers.RepeatedCompositeFieldContainer[LaneAnswer]
    output_digest: bytes
    forward_state_digest: bytes
    worker_id: str
    committed_at: _timestamp_pb2.Timestamp
    key_id: str
    signature: bytes
    forward_state_algorithm: _block_pb2.DigestAlgorithm
    def __init__(self, block_id: _Optional[str] = ..., request_id: _Optional[str] = ..., lanes: _Optional[_Iterable[_Union[LaneAnswer, _Mapping]]] = ..., output_digest: _Optional[bytes] = ..., forward_state_digest: _Optional[bytes] = ..., worker_id: _Optional[str] = ..., committed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., key_id: _Optional[str] = ..., signature: _Optional[bytes] = ..., forward_state_algorithm: _Optional[_Union[_block_pb2.DigestAlgorithm, str]] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("block_id", "request_id", "reason", "detail", "worker_id", "rejected_at", "key_id", "signature")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REJECTED_AT_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    request_id: str
    reason: str
    detail: str
    worker_id: str
    rejected_at: _timestamp_pb2.Timestamp
    key_id: str
    signature: bytes
    def __init__(self, block_id: _Optional[str] = ..., request_id: _Optional[str] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., worker_id: _Optional[str] = ..., rejected_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., key_id: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RegistryEntry(_message.Message):
    __slots__ = ("state", "block_id", "worker_id", "lease_expires_at", "attempt", "commit", "rejection", "key_id", "signature")
    STATE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    state: ClaimState
    block_id: str
    worker_id: str
    lease_expires_at: _timestamp_pb2.Timestamp
    attempt: int
    commit: Commit
    rejection: Rejection
    key_id: str
    signature: bytes
    def __init__(self, state: _Optional[_Union[ClaimState, str]] = ..., block_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attempt: _Optional[int] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., rejection: _Optional[_Union[Rejection, _Mapping]] = ..., key_id: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...
