"""A stand-in SGLang server (stdlib ``http.server`` in a thread) answering the endpoints
``corpusd pin --engine`` uses, as sglang 0.5.10.post1's ``entrypoints/http_server.py`` does:
``GET /server_info`` (``ServerArgs`` as a dict plus ``version``), ``POST /generate`` (JSON),
``POST /flush_cache`` (plain text).

:class:`CaptureEngine` adds what a real server with the capture backend does on ``/generate``:
prefill (corpusd's own prefill, bf16, standing in for SGLang's), put every whole page into a host
pool shaped as SGLang's, and back the pages up through the real ``CorpusdHiCacheStorage`` in
capture mode (``batch_set_v1``), batch by batch as ``cache_controller._page_backup`` does.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from corpusd.engine.client import CLASS, MODULE

VERSION = "0.5.10.post1"


def server_info(spool: Path | None, model: Path, page_size: int = 64) -> dict[str, Any]:
    """What ``/server_info`` holds for a server started with (``spool``) or without the capture
    backend (the fields the pin reads, with SGLang's names and types)."""
    info: dict[str, Any] = {
        "model_path": str(model),
        "page_size": page_size,
        "kv_cache_dtype": "auto",
        "enable_hierarchical_cache": False,
        "hicache_write_policy": "write_through",
        "hicache_storage_backend": None,
        "hicache_storage_backend_extra_config": None,
        "version": VERSION,
    }
    if spool is not None:
        extra = {
            "backend_name": "corpusd", "module_path": MODULE, "class_name": CLASS,
            "interface_v1": 1, "corpusd_capture": str(spool), "model_path": str(model),
        }  # fmt: skip
        info.update(
            enable_hierarchical_cache=True,
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(extra),
        )
    return info


class StandInEngine:
    def __init__(
        self,
        info: dict[str, Any],
        on_generate: Callable[[list[int], int], list[int]] | None = None,
    ) -> None:
        """``on_generate(input_ids, max_new_tokens)`` → the output ids ``/generate`` answers."""
        self.info, self.on_generate = info, on_generate
        self.calls: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                outer.calls.append(f"GET {self.path}")
                if self.path == "/server_info":
                    self._reply(200, json.dumps(outer.info).encode())
                else:
                    self._reply(404, b'{"detail":"Not Found"}')

            def do_POST(self) -> None:
                outer.calls.append(f"POST {self.path}")
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if self.path == "/flush_cache":
                    self._reply(200, b"Cache flushed.\n", "text/plain")
                elif self.path == "/generate" and outer.on_generate is not None:
                    n_new = int(body["sampling_params"]["max_new_tokens"])
                    ids = outer.on_generate(body["input_ids"], n_new)
                    self._reply(200, json.dumps({"output_ids": ids, "meta_info": {}}).encode())
                else:
                    self._reply(404, b'{"detail":"Not Found"}')

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class CaptureEngine(StandInEngine):
    """The stand-in with the capture backend (``hicache``: the module, loaded by
    ``sglang_host.load_hicache``), a host pool of ``kv_dtype`` rows in ``layout``."""

    def __init__(
        self, hicache: ModuleType, spool: Path, model: Path, kv_dtype: str = "bfloat16",
        layout: str = "layer_first", host_pages: int = 16, batch: int = 2,
    ) -> None:  # fmt: skip
        from corpusd.model import ModelConfig
        from tests.support.sglang_host import FakeNSAHostPool

        cfg = ModelConfig.from_dir(model)
        self.model_dir, self.kv_dtype, self.batch = model, kv_dtype, batch
        extra = json.loads(server_info(spool, model)["hicache_storage_backend_extra_config"])
        self.backend = hicache.CorpusdHiCacheStorage(
            SimpleNamespace(extra_config=extra, model_name=str(model), tp_rank=0)
        )
        self.host = FakeNSAHostPool(layout, kv_dtype, cfg.num_hidden_layers, host_pages)
        self.backend.register_mem_pool_host(self.host)  # as HiCacheController does
        self.prefills: list[int] = []
        super().__init__(server_info(spool, model), self.prefill)

    def prefill(self, ids: list[int], n_new: int) -> list[int]:
        """SGLang's work for one request: prefill ``ids`` (in 256-token chunks, as a normal pin
        does), decode ``n_new − 1`` steps greedily (the first output token is the stand-in's
        choice), then back up every whole page of the committed KV (``ids`` + outputs but the
        last)."""
        from corpusd.corpus.layout import Layout
        from corpusd.corpus.pin import prefill
        from corpusd.model import forward_tokens, load_model
        from requester.sglang.pagehash import page_hashes
        from tests.support.sglang_host import fill_page

        self.prefills.append(len(ids))
        model = load_model(self.model_dir, dtype=torch.bfloat16)
        cache = prefill(model, Layout(tuple(ids), ()), 256, io.StringIO())
        out = [ids[-1] % 200 + 7]
        for _ in range(n_new - 1):
            logits = forward_tokens(model, torch.tensor(out[-1:]), cache)
            assert logits is not None
            out.append(int(logits[-1].argmax()))
        committed = ids + out[:-1]
        p = self.host.page_size
        keys = page_hashes(committed, p)  # whole pages only, as SGLang backs up
        slots = []
        for i in range(len(keys)):
            hp = (3 * i + 1) % self.host.page_num  # scattered host pages
            sl = slice(i * p, i * p + p)
            latent = torch.stack([x[sl] for x in cache.latent])
            index_keys = torch.stack([x[sl] for x in cache.index_keys])
            fill_page(self.host, hp, latent, index_keys, self.kv_dtype)
            slots.append(torch.arange(hp * p, hp * p + p))
        host_indices = torch.cat(slots)
        for b in range(0, len(keys), self.batch):
            ok = self.backend.batch_set_v1(
                keys[b : b + self.batch], host_indices[b * p : (b + self.batch) * p]
            )
            assert all(ok), f"capture refused a page: {ok}"
        return out
