from corpusd.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttendRequest(_message.Message):
    __slots__ = ("corpus_id", "layer", "q", "rows", "scale")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    layer: int
    q: _tensor_pb2.Tensor
    rows: _tensor_pb2.Tensor
    scale: float
    def __init__(self, corpus_id: _Optional[str] = ..., layer: _Optional[int] = ..., q: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., scale: _Optional[float] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ("o", "lse", "kernel", "compute_us")
    O_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    o: _tensor_pb2.Tensor
    lse: _tensor_pb2.Tensor
    kernel: str
    compute_us: float
    def __init__(self, o: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., lse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., kernel: _Optional[str] = ..., compute_us: _Optional[float] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("corpus_id", "layers", "pages", "index_keys")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    INDEX_KEYS_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    pages: _containers.RepeatedScalarFieldContainer[int]
    index_keys: bool
    def __init__(self, corpus_id: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., pages: _Optional[_Iterable[int]] = ..., index_keys: _Optional[bool] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("latent", "index_keys")
    LATENT_FIELD_NUMBER: _ClassVar[int]
    INDEX_KEYS_FIELD_NUMBER: _ClassVar[int]
    latent: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    index_keys: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    def __init__(self, latent: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., index_keys: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ...) -> None: ...

class IndexTopKRequest(_message.Message):
    __slots__ = ("corpus_id", "layer", "q", "weights", "limit", "k", "arith")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ARITH_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    layer: int
    q: _tensor_pb2.Tensor
    weights: _tensor_pb2.Tensor
    limit: _tensor_pb2.Tensor
    k: int
    arith: str
    def __init__(self, corpus_id: _Optional[str] = ..., layer: _Optional[int] = ..., q: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., weights: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., limit: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., k: _Optional[int] = ..., arith: _Optional[str] = ...) -> None: ...

class IndexTopKResponse(_message.Message):
    __slots__ = ("positions", "scores")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    positions: _tensor_pb2.Tensor
    scores: _tensor_pb2.Tensor
    def __init__(self, positions: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., scores: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class IndexKeysRequest(_message.Message):
    __slots__ = ("corpus_id", "layer")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    layer: int
    def __init__(self, corpus_id: _Optional[str] = ..., layer: _Optional[int] = ...) -> None: ...

class IndexKeysChunk(_message.Message):
    __slots__ = ("pages", "keys")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedScalarFieldContainer[int]
    keys: _tensor_pb2.Tensor
    def __init__(self, pages: _Optional[_Iterable[int]] = ..., keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("corpus_id", "pages")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, corpus_id: _Optional[str] = ..., pages: _Optional[_Iterable[int]] = ...) -> None: ...

class PageFrame(_message.Message):
    __slots__ = ("page", "frame")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    page: int
    frame: int
    def __init__(self, page: _Optional[int] = ..., frame: _Optional[int] = ...) -> None: ...

class AssignResponse(_message.Message):
    __slots__ = ("frames", "page_size")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[PageFrame]
    page_size: int
    def __init__(self, frames: _Optional[_Iterable[_Union[PageFrame, _Mapping]]] = ..., page_size: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("corpus_id", "pages")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, corpus_id: _Optional[str] = ..., pages: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("freed",)
    FREED_FIELD_NUMBER: _ClassVar[int]
    freed: int
    def __init__(self, freed: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CorpusHeld(_message.Message):
    __slots__ = ("corpus_id", "frames", "tokens")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    frames: _containers.RepeatedCompositeFieldContainer[PageFrame]
    tokens: int
    def __init__(self, corpus_id: _Optional[str] = ..., frames: _Optional[_Iterable[_Union[PageFrame, _Mapping]]] = ..., tokens: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("holder_id", "device", "kernel", "page_size", "n_layers", "capacity_frames", "used_frames", "active_flows", "queued_flows", "corpora", "model_fingerprint")
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FRAMES_FIELD_NUMBER: _ClassVar[int]
    USED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FLOWS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FLOWS_FIELD_NUMBER: _ClassVar[int]
    CORPORA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    holder_id: str
    device: str
    kernel: str
    page_size: int
    n_layers: int
    capacity_frames: int
    used_frames: int
    active_flows: int
    queued_flows: int
    corpora: _containers.RepeatedCompositeFieldContainer[CorpusHeld]
    model_fingerprint: str
    def __init__(self, holder_id: _Optional[str] = ..., device: _Optional[str] = ..., kernel: _Optional[str] = ..., page_size: _Optional[int] = ..., n_layers: _Optional[int] = ..., capacity_frames: _Optional[int] = ..., used_frames: _Optional[int] = ..., active_flows: _Optional[int] = ..., queued_flows: _Optional[int] = ..., corpora: _Optional[_Iterable[_Union[CorpusHeld, _Mapping]]] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class SharePoolRequest(_message.Message):
    __slots__ = ("device_uuid", "peer")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    peer: bool
    def __init__(self, device_uuid: _Optional[str] = ..., peer: _Optional[bool] = ...) -> None: ...

class SharedTensor(_message.Message):
    __slots__ = ("device_uuid", "shape", "dtype", "storage_offset", "handle", "alloc_bytes", "alloc_offset", "ref_counter", "ref_counter_offset", "event", "event_sync")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    ALLOC_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    storage_offset: int
    handle: bytes
    alloc_bytes: int
    alloc_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync: bool
    def __init__(self, device_uuid: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., storage_offset: _Optional[int] = ..., handle: _Optional[bytes] = ..., alloc_bytes: _Optional[int] = ..., alloc_offset: _Optional[int] = ..., ref_counter: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event: _Optional[bytes] = ..., event_sync: _Optional[bool] = ...) -> None: ...

class SharePoolResponse(_message.Message):
    __slots__ = ("latent", "page_size", "d_v", "holder_id", "incarnation")
    LATENT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    D_V_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    latent: _containers.RepeatedCompositeFieldContainer[SharedTensor]
    page_size: int
    d_v: int
    holder_id: str
    incarnation: str
    def __init__(self, latent: _Optional[_Iterable[_Union[SharedTensor, _Mapping]]] = ..., page_size: _Optional[int] = ..., d_v: _Optional[int] = ..., holder_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...
