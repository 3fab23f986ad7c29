import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]

class CaptureMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPTURE_MODE_UNSPECIFIED: _ClassVar[CaptureMode]
    CAPTURE_MODE_FINAL_HIDDEN: _ClassVar[CaptureMode]

class DigestAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIGEST_ALGORITHM_UNSPECIFIED: _ClassVar[DigestAlgorithm]
    DIGEST_ALGORITHM_SHA256: _ClassVar[DigestAlgorithm]
    DIGEST_ALGORITHM_BLAKE3: _ClassVar[DigestAlgorithm]
    DIGEST_ALGORITHM_SLOT_CHECKSUM: _ClassVar[DigestAlgorithm]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_BUS: _ClassVar[Transport]
    TRANSPORT_LOCAL: _ClassVar[Transport]
    TRANSPORT_HOST: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
CAPTURE_MODE_UNSPECIFIED: CaptureMode
CAPTURE_MODE_FINAL_HIDDEN: CaptureMode
DIGEST_ALGORITHM_UNSPECIFIED: DigestAlgorithm
DIGEST_ALGORITHM_SHA256: DigestAlgorithm
DIGEST_ALGORITHM_BLAKE3: DigestAlgorithm
DIGEST_ALGORITHM_SLOT_CHECKSUM: DigestAlgorithm
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_BUS: Transport
TRANSPORT_LOCAL: Transport
TRANSPORT_HOST: Transport
TRANSPORT_CUDA_IPC: Transport

class CudaIpcRows(_message.Message):
    __slots__ = ("device_uuid", "mem_handle", "storage_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "pool", "rows_offset_bytes")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ROWS_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    mem_handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    pool: str
    rows_offset_bytes: int
    def __init__(self, device_uuid: _Optional[str] = ..., mem_handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., pool: _Optional[str] = ..., rows_offset_bytes: _Optional[int] = ...) -> None: ...

class RowsLocator(_message.Message):
    __slots__ = ("transport", "placement", "slot", "region", "cuda_ipc")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    placement: str
    slot: int
    region: str
    cuda_ipc: CudaIpcRows
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., placement: _Optional[str] = ..., slot: _Optional[int] = ..., region: _Optional[str] = ..., cuda_ipc: _Optional[_Union[CudaIpcRows, _Mapping]] = ...) -> None: ...

class Lane(_message.Message):
    __slots__ = ("request_id", "lane_index", "row_offset", "row_count", "answer_depth", "prompt_token_ids", "rows_of_lane")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_OF_LANE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lane_index: int
    row_offset: int
    row_count: int
    answer_depth: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    rows_of_lane: int
    def __init__(self, request_id: _Optional[str] = ..., lane_index: _Optional[int] = ..., row_offset: _Optional[int] = ..., row_count: _Optional[int] = ..., answer_depth: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., rows_of_lane: _Optional[int] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("lanes", "total_rows", "hidden_size", "dtype", "capture_mode")
    LANES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_MODE_FIELD_NUMBER: _ClassVar[int]
    lanes: _containers.RepeatedCompositeFieldContainer[Lane]
    total_rows: int
    hidden_size: int
    dtype: Dtype
    capture_mode: CaptureMode
    def __init__(self, lanes: _Optional[_Iterable[_Union[Lane, _Mapping]]] = ..., total_rows: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., capture_mode: _Optional[_Union[CaptureMode, str]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "seed", "ignore_eos", "top_k", "top_p", "min_p", "min_tokens", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    seed: int
    ignore_eos: bool
    top_k: int
    top_p: float
    min_p: float
    min_tokens: int
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ...) -> None: ...

class StateBlockHeader(_message.Message):
    __slots__ = ("request_id", "block_id", "model", "layout", "layout_digest", "forward_state_digest", "base_model_digest", "lm_head_digest", "decoder_digest", "sampling", "created_at", "expires_at", "key_id", "signature", "forward_state_algorithm", "locator")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FORWARD_STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LM_HEAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DECODER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_STATE_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    LOCATOR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_id: str
    model: str
    layout: Layout
    layout_digest: bytes
    forward_state_digest: bytes
    base_model_digest: bytes
    lm_head_digest: bytes
    decoder_digest: bytes
    sampling: _containers.RepeatedCompositeFieldContainer[SamplingParams]
    created_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    key_id: str
    signature: bytes
    forward_state_algorithm: DigestAlgorithm
    locator: RowsLocator
    def __init__(self, request_id: _Optional[str] = ..., block_id: _Optional[str] = ..., model: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., layout_digest: _Optional[bytes] = ..., forward_state_digest: _Optional[bytes] = ..., base_model_digest: _Optional[bytes] = ..., lm_head_digest: _Optional[bytes] = ..., decoder_digest: _Optional[bytes] = ..., sampling: _Optional[_Iterable[_Union[SamplingParams, _Mapping]]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., key_id: _Optional[str] = ..., signature: _Optional[bytes] = ..., forward_state_algorithm: _Optional[_Union[DigestAlgorithm, str]] = ..., locator: _Optional[_Union[RowsLocator, _Mapping]] = ...) -> None: ...

class ObjectRef(_message.Message):
    __slots__ = ("bucket", "name", "digest", "size")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    bucket: str
    name: str
    digest: bytes
    size: int
    def __init__(self, bucket: _Optional[str] = ..., name: _Optional[str] = ..., digest: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("inline_rows", "object_ref")
    INLINE_ROWS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_REF_FIELD_NUMBER: _ClassVar[int]
    inline_rows: bytes
    object_ref: ObjectRef
    def __init__(self, inline_rows: _Optional[bytes] = ..., object_ref: _Optional[_Union[ObjectRef, _Mapping]] = ...) -> None: ...

class StateBlock(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: StateBlockHeader
    payload: Payload
    def __init__(self, header: _Optional[_Union[StateBlockHeader, _Mapping]] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ...) -> None: ...
