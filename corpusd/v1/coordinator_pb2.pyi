from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HolderAddress(_message.Message):
    __slots__ = ("holder_id", "address", "device", "capacity_frames", "live", "page_size", "model_fingerprint", "dtype")
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FRAMES_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    holder_id: str
    address: str
    device: str
    capacity_frames: int
    live: bool
    page_size: int
    model_fingerprint: str
    dtype: str
    def __init__(self, holder_id: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., capacity_frames: _Optional[int] = ..., live: _Optional[bool] = ..., page_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class RegisterHolderRequest(_message.Message):
    __slots__ = ("holder",)
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    holder: HolderAddress
    def __init__(self, holder: _Optional[_Union[HolderAddress, _Mapping]] = ...) -> None: ...

class RegisterHolderResponse(_message.Message):
    __slots__ = ("lease_seconds",)
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    def __init__(self, lease_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("holder_id", "used_frames", "active_flows", "elbow_flows", "queue_depth", "hot_pages", "fanin_mean")
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    USED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FLOWS_FIELD_NUMBER: _ClassVar[int]
    ELBOW_FLOWS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    HOT_PAGES_FIELD_NUMBER: _ClassVar[int]
    FANIN_MEAN_FIELD_NUMBER: _ClassVar[int]
    holder_id: str
    used_frames: int
    active_flows: int
    elbow_flows: int
    queue_depth: int
    hot_pages: _containers.RepeatedCompositeFieldContainer[PageHeat]
    fanin_mean: float
    def __init__(self, holder_id: _Optional[str] = ..., used_frames: _Optional[int] = ..., active_flows: _Optional[int] = ..., elbow_flows: _Optional[int] = ..., queue_depth: _Optional[int] = ..., hot_pages: _Optional[_Iterable[_Union[PageHeat, _Mapping]]] = ..., fanin_mean: _Optional[float] = ...) -> None: ...

class PageHeat(_message.Message):
    __slots__ = ("corpus_id", "page", "hits")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    page: int
    hits: int
    def __init__(self, corpus_id: _Optional[str] = ..., page: _Optional[int] = ..., hits: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_seconds",)
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    def __init__(self, lease_seconds: _Optional[float] = ...) -> None: ...

class CorpusInfo(_message.Message):
    __slots__ = ("corpus_id", "name", "state", "tokens", "pages", "page_size", "cp_degree", "replicas", "model_fingerprint", "holder_ids", "expired_holders", "queue_position", "created_at", "state_age_s", "head_len", "head_digest")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CP_DEGREE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HOLDER_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STATE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    HEAD_LEN_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    name: str
    state: str
    tokens: int
    pages: int
    page_size: int
    cp_degree: int
    replicas: int
    model_fingerprint: str
    holder_ids: _containers.RepeatedScalarFieldContainer[str]
    expired_holders: _containers.RepeatedScalarFieldContainer[str]
    queue_position: int
    created_at: str
    state_age_s: float
    head_len: int
    head_digest: str
    def __init__(self, corpus_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[str] = ..., tokens: _Optional[int] = ..., pages: _Optional[int] = ..., page_size: _Optional[int] = ..., cp_degree: _Optional[int] = ..., replicas: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., holder_ids: _Optional[_Iterable[str]] = ..., expired_holders: _Optional[_Iterable[str]] = ..., queue_position: _Optional[int] = ..., created_at: _Optional[str] = ..., state_age_s: _Optional[float] = ..., head_len: _Optional[int] = ..., head_digest: _Optional[str] = ...) -> None: ...

class ListCorporaRequest(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    def __init__(self, stored: _Optional[bool] = ...) -> None: ...

class ListCorporaResponse(_message.Message):
    __slots__ = ("corpora",)
    CORPORA_FIELD_NUMBER: _ClassVar[int]
    corpora: _containers.RepeatedCompositeFieldContainer[CorpusInfo]
    def __init__(self, corpora: _Optional[_Iterable[_Union[CorpusInfo, _Mapping]]] = ...) -> None: ...

class GetPageTableRequest(_message.Message):
    __slots__ = ("corpus_id",)
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    def __init__(self, corpus_id: _Optional[str] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("holder_id", "frame")
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    holder_id: str
    frame: int
    def __init__(self, holder_id: _Optional[str] = ..., frame: _Optional[int] = ...) -> None: ...

class PageEntry(_message.Message):
    __slots__ = ("page", "replicas")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    page: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, page: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class PageTable(_message.Message):
    __slots__ = ("corpus", "holders", "pages")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    corpus: CorpusInfo
    holders: _containers.RepeatedCompositeFieldContainer[HolderAddress]
    pages: _containers.RepeatedCompositeFieldContainer[PageEntry]
    def __init__(self, corpus: _Optional[_Union[CorpusInfo, _Mapping]] = ..., holders: _Optional[_Iterable[_Union[HolderAddress, _Mapping]]] = ..., pages: _Optional[_Iterable[_Union[PageEntry, _Mapping]]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("corpus_id", "replicas", "wait")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    replicas: int
    wait: bool
    def __init__(self, corpus_id: _Optional[str] = ..., replicas: _Optional[int] = ..., wait: _Optional[bool] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: PageTable
    def __init__(self, table: _Optional[_Union[PageTable, _Mapping]] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("corpus_id", "delete")
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    delete: bool
    def __init__(self, corpus_id: _Optional[str] = ..., delete: _Optional[bool] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("frames_freed", "corpus", "deleted", "bytes_deleted")
    FRAMES_FREED_FIELD_NUMBER: _ClassVar[int]
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DELETED_FIELD_NUMBER: _ClassVar[int]
    frames_freed: int
    corpus: CorpusInfo
    deleted: bool
    bytes_deleted: int
    def __init__(self, frames_freed: _Optional[int] = ..., corpus: _Optional[_Union[CorpusInfo, _Mapping]] = ..., deleted: _Optional[bool] = ..., bytes_deleted: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("corpus_id",)
    CORPUS_ID_FIELD_NUMBER: _ClassVar[int]
    corpus_id: str
    def __init__(self, corpus_id: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("corpus", "deleted", "bytes_deleted")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DELETED_FIELD_NUMBER: _ClassVar[int]
    corpus: CorpusInfo
    deleted: bool
    bytes_deleted: int
    def __init__(self, corpus: _Optional[_Union[CorpusInfo, _Mapping]] = ..., deleted: _Optional[bool] = ..., bytes_deleted: _Optional[int] = ...) -> None: ...

class ListHoldersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HolderStatus(_message.Message):
    __slots__ = ("holder", "used_frames", "active_flows", "heartbeat_age_s", "placed_frames", "elbow_flows", "queue_depth")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    USED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FLOWS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    PLACED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    ELBOW_FLOWS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    holder: HolderAddress
    used_frames: int
    active_flows: int
    heartbeat_age_s: float
    placed_frames: int
    elbow_flows: int
    queue_depth: int
    def __init__(self, holder: _Optional[_Union[HolderAddress, _Mapping]] = ..., used_frames: _Optional[int] = ..., active_flows: _Optional[int] = ..., heartbeat_age_s: _Optional[float] = ..., placed_frames: _Optional[int] = ..., elbow_flows: _Optional[int] = ..., queue_depth: _Optional[int] = ...) -> None: ...

class ListHoldersResponse(_message.Message):
    __slots__ = ("holders", "lease_seconds")
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedCompositeFieldContainer[HolderStatus]
    lease_seconds: float
    def __init__(self, holders: _Optional[_Iterable[_Union[HolderStatus, _Mapping]]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("worker_id", "address", "sessions", "generating", "max_batch", "kv_tokens", "kv_capacity", "corpora", "metrics_url")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CORPORA_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    sessions: int
    generating: int
    max_batch: int
    kv_tokens: int
    kv_capacity: int
    corpora: _containers.RepeatedScalarFieldContainer[str]
    metrics_url: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., sessions: _Optional[int] = ..., generating: _Optional[int] = ..., max_batch: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., kv_capacity: _Optional[int] = ..., corpora: _Optional[_Iterable[str]] = ..., metrics_url: _Optional[str] = ...) -> None: ...

class ReportWorkerResponse(_message.Message):
    __slots__ = ("lease_seconds", "unpinned")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    unpinned: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_seconds: _Optional[float] = ..., unpinned: _Optional[_Iterable[str]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("report", "age_s", "live")
    REPORT_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    report: WorkerReport
    age_s: float
    live: bool
    def __init__(self, report: _Optional[_Union[WorkerReport, _Mapping]] = ..., age_s: _Optional[float] = ..., live: _Optional[bool] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class ChooseWorkerRequest(_message.Message):
    __slots__ = ("session_tokens", "exclude")
    SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    session_tokens: int
    exclude: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_tokens: _Optional[int] = ..., exclude: _Optional[_Iterable[str]] = ...) -> None: ...

class ChooseWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...
