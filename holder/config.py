"""The holder process's configuration (CLI flags derive from these defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from corpusd.corpus.manifest import PAGE_SIZE
from corpusd.daemon_config import DaemonConfig, check_address, non_negative, positive
from corpusd.formats import KV_FORMATS

DTYPES = ("float32", "bfloat16")
GPU_HOST_THREADS = 2


@dataclass(frozen=True, slots=True)
class HolderConfig(DaemonConfig):
    """A holder; its state directory keeps assignments.json (reloaded on restart)."""

    ROLE = "holder"
    STATE_HOME = "holders/default"

    model: str | None = field(
        default=None,
        metadata={
            "help": "model directory: pool geometry and fingerprint check "
            "(default: the embedded tiny model)"
        },
    )
    device: str = field(
        default="cpu",
        metadata={"help": "cpu, or cuda:N (FlashMLA / Triton kernels)"},
    )
    holder_id: str = field(
        default="",
        metadata={
            "help": "name in the coordinator's registry "
            "(default: the one an earlier run in --state-dir used, else holder-PORT)"
        },
    )
    capacity_tokens: int = field(
        default=1 << 20,
        metadata={"help": "pool size in corpus tokens (preallocated)"},
    )
    capacity_bytes: int = field(
        default=0,
        metadata={"help": "> 0: size the pool by bytes instead (latent + index keys, all layers)"},
    )
    page_size: int = field(
        default=PAGE_SIZE,
        metadata={"help": "tokens per page; must match the pins"},
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "pool dtype: float32 or bfloat16; must match the pins"},
    )
    kv_format: str = field(
        default="plain",
        metadata={
            "help": "latent row format of the pool: plain or fp8_e4m3 (FlashMLA's 656-byte "
            "rows); must match the pins",
            "choices": KV_FORMATS,
        },
    )
    kernel: str = field(
        default="auto",
        metadata={"help": "partial-attention kernel: auto, torch, flashmla or triton"},
    )
    max_flows: int = field(
        default=8,
        metadata={
            "help": "Attend/Fetch executions at once (the fan-in cap; more wait in the queue)"
        },
    )
    staging_streams: int = field(
        default=8,
        metadata={"help": "CUDA streams that stage outgoing partials / pages (GPU holders)"},
    )
    nvshmem_peers: int = field(
        default=0,
        metadata={"help": "> 0: offer an NVSHMEM job with this many requester slots (GPU, bf16)"},
    )
    nvshmem_rows: int = field(
        default=64,
        metadata={
            "help": "NVSHMEM ring slot: query rows per request (× the model's heads, at least "
            "128, × --nvshmem-topk)"
        },
    )
    nvshmem_topk: int = field(
        default=2048,
        metadata={"help": "NVSHMEM ring slot: selected rows per query row"},
    )
    nvshmem_fetch_rows: int = field(
        default=16384,
        metadata={"help": "NVSHMEM ring slot: pool rows per fetch reply"},
    )
    max_queue: int = field(
        default=1024,
        metadata={"help": "requests waiting for a flow slot before RESOURCE_EXHAUSTED"},
    )
    queue_timeout_s: float = field(
        default=10.0,
        metadata={"help": "seconds a request may wait for a flow slot"},
    )
    max_rows: int = field(default=8192, metadata={"help": "query rows of one Attend / IndexTopK"})
    max_k: int = field(default=16384, metadata={"help": "selected rows per query row"})
    max_message_bytes: int = field(default=256 << 20, metadata={"help": "largest gRPC message"})
    threads: int = field(
        default=0,
        metadata={"help": "torch intra-op threads per flow; 0: torch's default (CPU), 2 (GPU)"},
    )
    shared_reuse_delay_s: float = field(
        default=60.0,
        metadata={
            "help": "once the pool is shared over CUDA IPC (an SGLang worker on this GPU reads "
            "it in place), seconds a released frame waits before another corpus fills it, so "
            "a request running across its corpus's unpin reads its own rows that long (taken "
            "sooner only when the pool is otherwise full, logged); 0: at once"
        },
    )
    coordinator: str = field(
        default="",
        metadata={
            "help": "host:port[,host:port…]: register there on start and heartbeat within the "
            "lease (several: coordinators sharing an etcd state; the leader answers)"
        },
    )
    advertise: str = field(
        default="",
        metadata={
            "help": "host:port registered with the coordinator, the address agents and the "
            "coordinator dial: a NAT, load balancer or TCP proxy in front of this holder; its "
            "TLS certificate must name that host ('': --host and the port it listens on)"
        },
    )

    def __post_init__(self) -> None:
        DaemonConfig.__post_init__(self)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        positive(
            self,
            "capacity_tokens",
            "page_size",
            "max_flows",
            "staging_streams",
            "max_rows",
            "max_k",
        )
        non_negative(self, "shared_reuse_delay_s", "capacity_bytes")
        if self.capacity_tokens < self.page_size:
            raise ValueError(f"capacity_tokens {self.capacity_tokens} is less than one page")
        if self.nvshmem_peers < 0 or min(self.nvshmem_rows, self.nvshmem_topk) <= 0:
            raise ValueError("nvshmem_peers must be >= 0, nvshmem_rows / nvshmem_topk > 0")
        if self.nvshmem_peers and not self.device.startswith("cuda"):
            raise ValueError("nvshmem_peers needs a cuda device")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        if self.nvshmem_peers and self.kv_format != "plain":
            raise ValueError("nvshmem_peers needs --kv-format plain (the ring attends plain rows)")
        if self.nvshmem_peers and self.dtype != "bfloat16":
            # the ring carries q and O in bf16: a float32 pool would answer other bits than its
            # gRPC Attend does
            raise ValueError("nvshmem_peers needs --dtype bfloat16 (the ring is bf16)")
        if not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device must be cpu or cuda:N, got {self.device!r}")
        if self.advertise:
            check_address("advertise", self.advertise)

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
