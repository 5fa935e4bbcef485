from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("requester_id", "host", "probe")
    REQUESTER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    requester_id: str
    host: str
    probe: bool
    def __init__(self, requester_id: _Optional[str] = ..., host: _Optional[str] = ..., probe: _Optional[bool] = ...) -> None: ...

class RingGeometry(_message.Message):
    __slots__ = ("peers", "depth", "req_bytes", "rep_bytes")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    REQ_BYTES_FIELD_NUMBER: _ClassVar[int]
    REP_BYTES_FIELD_NUMBER: _ClassVar[int]
    peers: int
    depth: int
    req_bytes: int
    rep_bytes: int
    def __init__(self, peers: _Optional[int] = ..., depth: _Optional[int] = ..., req_bytes: _Optional[int] = ..., rep_bytes: _Optional[int] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("uid", "rank", "nranks", "job_id", "ring", "host")
    UID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NRANKS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    uid: bytes
    rank: int
    nranks: int
    job_id: str
    ring: RingGeometry
    host: str
    def __init__(self, uid: _Optional[bytes] = ..., rank: _Optional[int] = ..., nranks: _Optional[int] = ..., job_id: _Optional[str] = ..., ring: _Optional[_Union[RingGeometry, _Mapping]] = ..., host: _Optional[str] = ...) -> None: ...

class OpenStreamRequest(_message.Message):
    __slots__ = ("rank", "mode", "corpus_id", "layer", "layers", "rows", "heads", "topk", "scale", "count", "echo_bytes", "direct", "compacted")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ECHO_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    COMPACTED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    mode: str
    corpus_id: str
    layer: int
    layers: int
    rows: int
    heads: int
    topk: int
    scale: float
    count: int
    echo_bytes: int
    direct: bool
    compacted: bool
    def __init__(self, rank: _Optional[int] = ..., mode: _Optional[str] = ..., corpus_id: _Optional[str] = ..., layer: _Optional[int] = ..., layers: _Optional[int] = ..., rows: _Optional[int] = ..., heads: _Optional[int] = ..., topk: _Optional[int] = ..., scale: _Optional[float] = ..., count: _Optional[int] = ..., echo_bytes: _Optional[int] = ..., direct: _Optional[bool] = ..., compacted: _Optional[bool] = ...) -> None: ...

class OpenStreamResponse(_message.Message):
    __slots__ = ("first_seq",)
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    first_seq: int
    def __init__(self, first_seq: _Optional[int] = ...) -> None: ...
