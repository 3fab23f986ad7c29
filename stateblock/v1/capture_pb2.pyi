from stateblock.v1 import block_pb2 as _block_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CaptureLane(_message.Message):
    __slots__ = ("prompt", "chat", "tokens", "sampling", "max_tokens")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatMessages
    tokens: TokenIds
    sampling: _block_pb2.SamplingParams
    max_tokens: int
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_block_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class CaptureRequest(_message.Message):
    __slots__ = ("request_id", "model", "lanes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    lanes: _containers.RepeatedCompositeFieldContainer[CaptureLane]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., lanes: _Optional[_Iterable[_Union[CaptureLane, _Mapping]]] = ...) -> None: ...

class CaptureResponse(_message.Message):
    __slots__ = ("request_id", "block_id", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., block_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: _Optional[bool] = ...) -> None: ...
