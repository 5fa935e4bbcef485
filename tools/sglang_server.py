"""One SGLang server and the corpusd it serves from, for ``tools/bench_sglang.py``: the corpusd
daemons (coordinator, holders, one agent) with corpora pinned, and ``python -m
sglang.launch_server`` per mode (stock; route with the plugin, its primitive forced as
``route@<p>``; fetch through the HiCache backend) with the flags every mode shares.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corpusd.corpus.store import PageStore
from corpusd.kernels.fp8_cache import ROW_BYTES
from requester.sglang.binding import request_fields
from tools.sglang_compare import forced_primitive, is_route, mode_tag, variant_env

if TYPE_CHECKING:  # the daemons (grpc) load in start_corpusd: a stock Server needs none
    from corpusd.daemon import Daemon

ROOT = Path(__file__).resolve().parent.parent
SGLANG_ENV = {
    # No 10-minute DeepGEMM JIT warm-up; prefill stays off the FA3 path the deps omit; one top-k
    # code path (unfused) in every mode, which the plugin needs.
    "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "0",
    "SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",
    "SGLANG_NSA_FUSE_TOPK": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}
SGLANG_FLAGS = [
    "--attention-backend", "nsa", "--page-size", "64",
    "--nsa-prefill-backend", "flashmla_sparse", "--nsa-decode-backend", "flashmla_sparse",
    "--kv-cache-dtype", "auto", "--skip-tokenizer-init",
    "--grammar-backend", "none", "--enable-metrics", "--context-length", "16384",
    "--enable-fp32-lm-head",
    "--mem-fraction-static", "0.3", "--max-total-tokens", "65536", "--log-level", "info",
]  # fmt: skip


def sglang_flags(kv_cache_dtype: str = "auto") -> list[str]:
    """:data:`SGLANG_FLAGS` with SGLang's KV cache in ``kv_cache_dtype``. ``fp8_e4m3`` takes
    ``flashmla_kv`` for prefill and decode: SGLang reads its fp8 cache in decode with
    ``flashmla_kv`` only (its ``flashmla_sparse`` decode hands the fp8 buffer to the bf16
    kernel), and ``flashmla_kv`` is what its own fp8 default (``flashmla_auto`` prefill) runs
    on SM90, so stock and route run the kernels stock SGLang picks for an fp8 cache."""
    flags = list(SGLANG_FLAGS)
    flags[flags.index("--kv-cache-dtype") + 1] = kv_cache_dtype
    if kv_cache_dtype == "fp8_e4m3":
        for name in ("--nsa-prefill-backend", "--nsa-decode-backend"):
            flags[flags.index(name) + 1] = "flashmla_kv"
    return flags


def pin_format(kv_cache_dtype: str) -> str:
    """The pins' latent row format: fp8 rows when SGLang's own cache is fp8, so every server
    (stock and route) and the holders attend the same fp8 pages."""
    return "fp8_e4m3" if kv_cache_dtype == "fp8_e4m3" else "plain"


def formats(kv_cache_dtype: str) -> dict[str, Any]:
    """What a result records of the formats: SGLang's cache, the pins' rows, the flags."""
    return {"kv_cache_dtype": kv_cache_dtype, "kv_format": pin_format(kv_cache_dtype),
            "sglang_flags": sglang_flags(kv_cache_dtype)}  # fmt: skip


@dataclass
class Corpusd:
    daemons: list[Daemon]
    coordinator: str
    store: Path
    tokens: dict[str, list[int]]  # corpus name → its tokens
    held: dict[str, Any] = field(default_factory=dict)  # residency(), once pinned

    def residency(self, model: Path, kv_format: str, device: str) -> dict[str, Any]:
        """The holders' ``corpusd_holder_bytes_resident`` gauges (their Prometheus endpoints)
        and what they come to per pinned token and layer, beside the row format's own bytes
        (issue 18: FlashMLA's 656-byte fp8 row plus the index key, in the holders' dtype: bf16
        on a GPU, float32 on CPU). Pages are whole, so a corpus's last page adds a little."""
        cfg = json.loads((model / "config.json").read_text())
        resident = {}
        for d in self.daemons:
            if d.state_dir.name.startswith("holder") and d.metrics_port > 0:
                url = f"http://127.0.0.1:{d.metrics_port}/metrics"
                with urllib.request.urlopen(url, timeout=5) as r:
                    text = r.read().decode()
                got = re.search(r"^corpusd_holder_bytes_resident(?:\{[^}]*\})? (\S+)$", text, re.M)
                resident[d.state_dir.name] = float(got.group(1)) if got else None
        tokens = sum(len(t) for t in self.tokens.values())
        layers = int(cfg["num_hidden_layers"])
        total = sum(v for v in resident.values() if v)
        elt = 4 if device == "cpu" else 2
        plain = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elt
        row = ROW_BYTES if kv_format == "fp8_e4m3" else plain
        return {
            "bytes_resident": resident,
            "pinned_tokens": tokens,
            "layers": layers,
            "bytes_per_token_layer": round(total / (tokens * layers), 1) if tokens else None,
            "format_bytes_per_token_layer": {"row": row, "index_key": cfg["index_head_dim"] * elt},
        }

    def stop(self) -> None:
        for d in reversed(self.daemons):
            try:
                d.stop(timeout=20)
            except subprocess.TimeoutExpired:
                d.kill()


def corpus_source(out: Path, n_bytes: int, first: str) -> Path:
    """A directory with ``n_bytes`` of this repo's text, starting at the file ``first``."""
    files = [ROOT / "README.md", *sorted((ROOT / "corpusd" / "model").glob("*.py"))]
    files = sorted(files, key=lambda p: p.name != first)
    text = "".join(p.read_text() for p in files)[:n_bytes]
    out.mkdir(parents=True, exist_ok=True)
    (out / "notes.md").write_text(text)
    return out


def start_corpusd(work: Path, model: Path, corpora: dict[str, tuple[int, str]], holders: int,
                  device: str, kv_format: str = "plain", engine: str = "",
                  capacity_tokens: int = 16384, sources: dict[str, Path] | None = None,
                  pin_device: str = "", replicas: int = 1,
                  ) -> Corpusd:  # fmt: skip
    """A coordinator, ``holders`` holders and an agent; each of ``corpora`` (name → bytes, first
    file) pinned through them, its latent rows in ``kv_format`` (``fp8_e4m3``: FlashMLA's fp8
    rows, held and attended as such). ``engine``: the URL of an SGLang server in capture mode
    (``Server("capture", …)``) whose prefill the pins store instead of corpusd's own (the
    engine's KV cache dtype then decides the format). ``device``: the holders', or a
    comma-separated list dealt to them in turn (``cuda:1`` puts every holder on the second GPU,
    ``cuda:0,cuda:1`` spreads them over two). ``capacity_tokens``: each holder's frames (below
    a corpus's length the pin spreads it over holders);
    ``sources``: a directory to pin per corpus name instead of this repo's text; ``pin_device``:
    where the pins prefill (``corpusd pin --device``; default its own, the CPU); ``replicas``:
    copies of each page on distinct holders."""
    from corpusd.coordinator.launch import start_coordinator
    from holder.launch import start_holder
    from requester.launch import start_agent

    store = work / "store"
    daemons: list[Daemon] = []
    try:
        coord = start_coordinator(work / "coordinator", store)
        daemons.append(coord)
        devices = device.split(",")
        device = devices[0]
        assert all((d == "cpu") == (device == "cpu") for d in devices), f"{devices=}: CPU or GPUs"
        extra = ["--coordinator", coord.address, "--capacity-tokens", str(capacity_tokens)]
        extra += ["--kv-format", kv_format]
        if device != "cpu":  # bf16 pages (as SGLang's pool), our Triton sparse-MLA kernel;
            # fp8 rows: the kernel auto picks, FlashMLA's fp8 decode on SM90 (stock fp8's kernel)
            kernel = "triton" if kv_format == "plain" else "auto"
            extra += ["--dtype", "bfloat16", "--kernel", kernel]
        for i in range(holders):
            on = ["--device", devices[i % len(devices)]]
            daemons.append(start_holder(store, work / f"holder-{i}", model, *extra, *on))
        daemons.append(start_agent(store, work / "agent", model, "--coordinator", coord.address))
        tokens = {}
        for name, (n_bytes, first) in corpora.items():
            src = (sources or {}).get(name) or corpus_source(work / "src" / name, n_bytes, first)
            pin = [sys.executable, "-m", "corpusd", "pin", "--corpus", str(src), "--name", name]
            pin += ["--model", str(model), "--store", str(store), "--coordinator", coord.address]
            pin += ["--dtype", "float32" if device == "cpu" else "bfloat16"]  # the holders' dtype
            pin += ["--kv-format", kv_format, "--replicas", str(replicas)]
            if engine:
                pin += ["--engine", engine]
            if pin_device:
                pin += ["--device", pin_device]
            subprocess.run(pin, check=True)
            ps = PageStore(store)
            tokens[name] = ps.read_tokens(ps.resolve(name)).tolist()
        return Corpusd(daemons, coord.address, store, tokens)
    except BaseException:
        for d in reversed(daemons):
            d.kill()
        raise


def start_pinned(
    work: Path, model: Path, corpora: dict[str, tuple[int, str]], holders: int, device: str,
    kv_cache_dtype: str, engine_port: int = 0, sources: dict[str, Path] | None = None,
    capacity_tokens: int = 16384,
) -> Corpusd:  # fmt: skip
    """:func:`start_corpusd` with the pins' format following SGLang's ``kv_cache_dtype``; with
    ``engine_port`` the corpora are pinned through a stock SGLang server in capture mode on that
    port (engine-true pages, issue 18), stopped before the measured servers start, and
    ``CORPUSD_STORE`` is set for the servers started after (the route plugin scores the engine's
    verbatim indexer pages when it can read the store)."""
    fmt = pin_format(kv_cache_dtype)
    if not engine_port:
        return start_corpusd(work, model, corpora, holders, device, fmt, sources=sources,
                             capacity_tokens=capacity_tokens)  # fmt: skip
    capture = Server("capture", model, engine_port, None, work / "sglang-capture.log", (),
                     kv_cache_dtype)  # fmt: skip
    try:
        capture.wait()
        cd = start_corpusd(work, model, corpora, holders, device, fmt, capture.url,
                           capacity_tokens, sources)  # fmt: skip
    finally:
        capture.stop()
    os.environ["CORPUSD_STORE"] = str(cd.store)
    return cd


# -- one SGLang server ---------------------------------------------------------------------------
def post_json(url: str, body: dict[str, Any], timeout: float = 600) -> Any:
    """POST ``body`` as JSON to ``url`` (e.g. a server's ``/generate``); the parsed reply.
    Raises urllib.error.HTTPError on a non-2xx status, OSError when unreachable."""
    head = {"Content-Type": "application/json"}
    req = urllib.request.Request(url, json.dumps(body).encode(), head)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """``python -m sglang.launch_server`` in ``mode`` (stock, route, route@<p>, fetch). ``cd`` is
    the corpusd that route and fetch serve from (stock needs none); ``flags`` replaces
    :func:`sglang_flags` (the model path, port and CUDA-graph flags are still added);
    ``extra_env`` is added to the server's environment (e.g. ``CORPUSD_SGLANG_DUMP``)."""

    def __init__(
        self, mode: str, model: Path, port: int, cd: Corpusd | None, log: Path,
        graph_bs: tuple[int, ...] = (), kv_cache_dtype: str = "auto",
        flags: list[str] | None = None, extra_env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        assert cd is not None or mode in ("stock", "capture"), f"{mode=} serves from a corpusd"
        env = {**os.environ, **SGLANG_ENV, **(extra_env or {})}
        base = sglang_flags(kv_cache_dtype) if flags is None else flags
        flags = ["--model-path", str(model), "--port", str(port), *base]
        prim = forced_primitive(mode)
        self.trace: Path | None = None
        self.metrics_url = ""
        if graph_bs and not prim:  # capture only the batch sizes measured (~12 s each)
            flags += ["--cuda-graph-max-bs", str(max(graph_bs)), "--cuda-graph-bs"]
            flags += [str(b) for b in sorted(graph_bs)]
        else:
            flags.append("--disable-cuda-graph")
        if is_route(mode):
            assert cd is not None
            env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "requester.sglang"
            env["CORPUSD_COORDINATOR"] = cd.coordinator
            # the device path's window: the longest corpus, in whole 1,024-token steps
            longest = max(map(len, cd.tokens.values()))
            env.setdefault("CORPUSD_SGLANG_WINDOW", str(-(-longest // 1024) * 1024))
        if mode == "route" or variant_env(mode):  # as in every earlier run: host path routes
            env.setdefault("CORPUSD_SGLANG_PRIMITIVE", "route")
            env.update(variant_env(mode))
        if prim:  # the predicate decides on the host path (no CUDA graphs there)
            self.trace = log.with_name(f"trace-{prim}.jsonl")
            self.trace.unlink(missing_ok=True)
            self.metrics_url = f"http://127.0.0.1:{port + 1}/metrics"
            env.update(
                CORPUSD_SGLANG_PATH="host", CORPUSD_SGLANG_PRIMITIVE=prim,
                CORPUSD_SGLANG_TRACE=str(self.trace), CORPUSD_SGLANG_METRICS_PORT=str(port + 1),
            )  # fmt: skip
        if mode == "capture":  # stock, whose HiCache backups go to a spool (corpusd pin --engine)
            extra_cfg = {
                "backend_name": "corpusd", "module_path": "requester.sglang.hicache",
                "class_name": "CorpusdHiCacheStorage", "interface_v1": 1,
                "corpusd_capture": str(log.parent / "spool-capture"), "model_path": str(model),
            }  # fmt: skip
            flags += [
                "--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
                "--hicache-storage-backend", "dynamic",
                "--hicache-storage-backend-extra-config", json.dumps(extra_cfg),
                "--hicache-mem-layout", "layer_first", "--hicache-io-backend", "kernel",
                "--hicache-size", "2",
            ]  # fmt: skip
        if mode == "fetch":
            assert cd is not None
            extra = {
                "backend_name": "corpusd",
                "module_path": "requester.sglang.hicache",
                "class_name": "CorpusdHiCacheStorage",
                "interface_v1": 1,
                "corpusd_store": str(cd.store),
                "model_path": str(model),
            }
            flags += [
                "--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
                "--hicache-storage-backend-extra-config", json.dumps(extra),
                "--hicache-storage-prefetch-policy", "wait_complete",
                "--hicache-mem-layout", "layer_first", "--hicache-io-backend", "kernel",
                "--hicache-size", "2",
            ]  # fmt: skip
        self.mode, self.url, self.log = mode, f"http://127.0.0.1:{port}", log
        self._log = log.open("w")
        cmd = [sys.executable, "-m", "sglang.launch_server", *flags]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 420) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.mode}: sglang exited ({self.proc.returncode}):\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.mode}: sglang not healthy in {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def post(self, body: dict[str, Any], timeout: float = 600) -> Any:
        return post_json(self.url + "/generate", body, timeout)

    def stream(self, body: dict[str, Any], timeout: float = 600) -> tuple[list[float], list[int]]:
        """Arrival times (monotonic) of each streamed chunk that carries new tokens, and the
        tokens (SGLang's chunks carry every token so far, unless --incremental-streaming-output).
        """
        times: list[float] = []
        tokens: list[int] = []
        for ids in stream_chunks(self.url, body, timeout):
            times.append(time.monotonic())
            tokens = ids
        return times, tokens

    def used_tokens(self) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        vals = [float(m) for m in re.findall(r"^sglang:num_used_tokens\{[^}]*\} (\S+)", text, re.M)]
        return max(vals, default=math.nan)


def stream_chunks(url: str, body: dict[str, Any], timeout: float = 600) -> Iterator[list[int]]:
    """``body`` streamed from the SGLang server at ``url``: each chunk's ``output_ids`` (every
    token so far), as it arrives. Raises RuntimeError with the server's message for a chunk
    that reports an error."""
    req = urllib.request.Request(
        url + "/generate",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            got = json.loads(line[5:])
            if "error" in got:
                raise RuntimeError(str(got["error"])[:300])
            yield got["output_ids"]


def request(
    prompt: list[int], n: int, mode: str, corpus: str, i: int, vocab: int, logprobs: bool,
    phase: str = "",
) -> dict:  # fmt: skip
    body: dict[str, Any] = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True},
    }
    if logprobs:
        body.update(
            return_logprob=True,
            logprob_start_len=len(prompt),
            token_ids_logprob=list(range(vocab)),
        )
    if is_route(mode):  # phase: the trace's name for a request (tools/sglang_compare.py)
        tag = mode_tag(mode)
        body.update(request_fields(corpus, f"{tag}-{phase}{i}-{time.monotonic_ns()}"))
    return body
