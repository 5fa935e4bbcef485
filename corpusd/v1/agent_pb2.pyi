from corpusd.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("corpus", "text", "tokens")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    corpus: str
    text: str
    tokens: TokenList
    def __init__(self, corpus: _Optional[str] = ..., text: _Optional[str] = ..., tokens: _Optional[_Union[TokenList, _Mapping]] = ...) -> None: ...

class TokenList(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "corpus_tokens", "prompt_tokens", "prompt_ids", "corpus_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CORPUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    corpus_tokens: int
    prompt_tokens: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    corpus_id: str
    def __init__(self, session_id: _Optional[str] = ..., corpus_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., corpus_id: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "stop_token_ids", "seed")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "params")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    params: SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentAttendRequest(_message.Message):
    __slots__ = ("corpus", "layer", "q", "positions", "index_q", "index_weights", "scale")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    INDEX_Q_FIELD_NUMBER: _ClassVar[int]
    INDEX_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    corpus: str
    layer: int
    q: _tensor_pb2.Tensor
    positions: _tensor_pb2.Tensor
    index_q: _tensor_pb2.Tensor
    index_weights: _tensor_pb2.Tensor
    scale: float
    def __init__(self, corpus: _Optional[str] = ..., layer: _Optional[int] = ..., q: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., positions: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., index_q: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., index_weights: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., scale: _Optional[float] = ...) -> None: ...

class AgentAttendResponse(_message.Message):
    __slots__ = ("o", "lse")
    O_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    o: _tensor_pb2.Tensor
    lse: _tensor_pb2.Tensor
    def __init__(self, o: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., lse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
