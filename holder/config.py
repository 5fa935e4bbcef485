"""The holder process's configuration (CLI flags derive from these defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from corpusd.corpus.manifest import PAGE_SIZE

DTYPES = ("float32", "bfloat16")
GPU_HOST_THREADS = 2


@dataclass(frozen=True, slots=True)
class HolderConfig:
    store: str = ""  # page store the corpora were pinned into ("" = $CORPUSD_STORE)
    state_dir: str = (
        ""  # assignments.json (restart), endpoint.json ("" = $CORPUSD_HOME/holders/default)
    )
    model: str | None = None  # pool geometry + fingerprint check; default: the embedded model
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port (written to endpoint.json)
    metrics_port: int = 0  # 0: pick a free port; -1: no metrics endpoint
    holder_id: str = ""
    capacity_tokens: int = 1 << 20
    capacity_bytes: int = 0  # > 0: size the pool by bytes instead (latent + index keys, all layers)
    page_size: int = PAGE_SIZE
    dtype: str = "float32"
    kernel: str = "auto"
    max_flows: int = 8
    staging_streams: int = 8  # CUDA streams that stage outgoing partials / pages (GPU holders)
    nvshmem_peers: int = 0  # > 0: offer an NVSHMEM job with this many requester slots (GPU only)
    nvshmem_rows: int = 64  # ring slot: query rows × 128 heads × nvshmem_topk per request
    nvshmem_topk: int = 2048
    nvshmem_fetch_rows: int = 16384  # ring slot: pool rows per fetch reply
    max_queue: int = 1024
    queue_timeout_s: float = 10.0
    max_rows: int = 8192  # rows of one Attend / IndexTopK
    max_k: int = 16384  # selected rows per query row
    max_message_bytes: int = 256 << 20
    threads: int = 0  # torch intra-op threads per flow; 0: torch's default (CPU), 2 (GPU)
    drain_s: float = 5.0
    coordinator: str = ""  # host:port: register there on start and heartbeat within the lease

    def __post_init__(self) -> None:
        if not self.store or not self.state_dir:
            raise ValueError("a holder needs a page store and a state directory")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for key in (
            "capacity_tokens",
            "page_size",
            "max_flows",
            "staging_streams",
            "max_rows",
            "max_k",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {self.capacity_bytes}")
        if self.capacity_tokens < self.page_size:
            raise ValueError(f"capacity_tokens {self.capacity_tokens} is less than one page")
        if self.nvshmem_peers < 0 or min(self.nvshmem_rows, self.nvshmem_topk) <= 0:
            raise ValueError("nvshmem_peers must be >= 0, nvshmem_rows / nvshmem_topk > 0")
        if self.nvshmem_peers and not self.device.startswith("cuda"):
            raise ValueError("nvshmem_peers needs a cuda device")
        if self.nvshmem_peers and self.dtype != "bfloat16":
            # the ring carries q and O in bf16: a float32 pool would answer other bits than its
            # gRPC Attend does
            raise ValueError("nvshmem_peers needs --dtype bfloat16 (the ring is bf16)")
        if not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device must be cpu or cuda:N, got {self.device!r}")

    @property
    def host_threads(self) -> int:
        """torch intra-op threads: a GPU holder's requests do no host compute (checks and the
        kernel run on the device), and every flow thread that calls an OpenMP-parallel op keeps
        a team of this many threads, which on a shared host oversubscribes the cores."""
        if self.threads:
            return self.threads
        return GPU_HOST_THREADS if self.device.startswith("cuda") else 0

    @property
    def frames(self) -> int:
        return self.capacity_tokens // self.page_size
