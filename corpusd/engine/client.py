"""The SGLang server a pin runs on, over its HTTP API (sglang 0.5.10.post1
``entrypoints/http_server.py``): ``GET /server_info`` (its ``ServerArgs`` as JSON, plus
``version``), ``POST /generate``, ``POST /flush_cache``. stdlib only: no torch, no sglang.

:func:`preflight` runs before anything is tokenized or stored and answers every way the engine
can be wrong with one :class:`EngineError` line (the CLI's exit code 2).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corpusd.engine.spool import ENGINE_JSON, EngineInfo

MODULE, CLASS = "requester.sglang.hicache", "CorpusdHiCacheStorage"


class EngineError(ValueError):
    """The engine is unreachable, misconfigured, serves another model, or failed the prefill."""


def capture_flags(spool: str = "/path/to/spool", model: str = "MODEL_DIR") -> str:
    """The ``sglang.launch_server`` flags that give a server the capture backend (on top of its
    usual ones). ``write_through`` backs every page up to storage as soon as its prefill is on
    the host (``hiradix_cache.py: write_through_threshold = 1``); ``model_path`` lets the backend
    fingerprint the checkpoint it serves."""
    extra = {
        "backend_name": "corpusd",
        "module_path": MODULE,
        "class_name": CLASS,
        "interface_v1": 1,
        "corpusd_capture": spool,
        "model_path": model,
    }
    return (
        f"--model-path {model} --enable-hierarchical-cache --hicache-write-policy write_through "
        f"--hicache-storage-backend dynamic --hicache-storage-backend-extra-config "
        f"'{json.dumps(extra)}'"
    )


@dataclass(frozen=True, slots=True)
class Engine:
    url: str
    timeout: float = 10.0

    def __post_init__(self) -> None:
        u = urllib.parse.urlsplit(self.url)
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
            raise EngineError(f"--engine {self.url!r}: want http://HOST:PORT (an SGLang server)")

    def _call(
        self, path: str, body: dict[str, Any] | None = None, timeout: float = 0, text: bool = False
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url.rstrip("/") + path, data, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            raise EngineError(f"engine {self.url}: {path} answered {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise EngineError(self._why(path, getattr(e, "reason", e), timeout)) from None
        if text:
            return raw.decode(errors="replace")
        try:
            return json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError:
            raise EngineError(
                f"engine {self.url}: {path} answered {raw[:80]!r}, not JSON: is it SGLang?"
            ) from None

    def _why(self, path: str, cause: object, timeout: float) -> str:
        """One line for a call that got no answer: never reached the server, the server gone
        mid-call (it answered before: a crash, e.g. SGLang's scheduler stopped on an assertion
        during the prefill), or no answer in time."""
        if isinstance(cause, TimeoutError):
            return f"engine {self.url}: {path} did not answer within {timeout or self.timeout:g} s"
        if isinstance(cause, (ConnectionResetError, http.client.HTTPException, BrokenPipeError)):
            return (
                f"engine {self.url} closed the connection during {path} without an answer: the "
                f"server stopped or restarted mid-call (its log says why) [{cause!r}]"
            )
        return f"engine {self.url} is unreachable: {cause}"

    def server_info(self) -> dict[str, Any]:
        info = self._call("/server_info")
        if not isinstance(info, dict) or "page_size" not in info:
            raise EngineError(f"engine {self.url}: /server_info has no page_size: is it SGLang?")
        return info

    def generate(self, input_ids: list[int], n_new: int, timeout: float) -> list[int]:
        """Prefill ``input_ids`` and generate exactly ``n_new`` tokens greedily (``ignore_eos``);
        returns their ids. Raises EngineError when the answer has not exactly ``n_new``."""
        params = {"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True}
        r = self._call("/generate", {"input_ids": input_ids, "sampling_params": params}, timeout)
        ids = r.get("output_ids") if isinstance(r, dict) else None
        if not isinstance(ids, list) or len(ids) != n_new:
            raise EngineError(
                f"engine {self.url}: /generate answered {str(r)[:120]}, not {n_new} output_ids"
            )
        return [int(t) for t in ids]

    def flush_cache(self) -> None:
        """Empty the server's radix cache (SGLang answers plain text; 400 while requests run)."""
        self._call("/flush_cache", {}, text=True)


def preflight(engine: Engine) -> tuple[dict[str, Any], EngineInfo, Path]:
    """The server's info, what its capture backend reports, and its spool directory. Raises
    EngineError: unreachable; not SGLang; no corpusd capture backend (the message gives the
    flags); a spool this process cannot read."""
    info = engine.server_info()
    try:
        extra = json.loads(info.get("hicache_storage_backend_extra_config") or "{}")
    except json.JSONDecodeError:
        extra = {}
    missing = [
        what
        for what, ok in (
            ("--enable-hierarchical-cache", info.get("enable_hierarchical_cache") is True),
            ("--hicache-write-policy write_through", info.get("hicache_write_policy")
             == "write_through"),
            ("--hicache-storage-backend dynamic", info.get("hicache_storage_backend") == "dynamic"),
            (f"module_path {MODULE}", extra.get("module_path") == MODULE),
            (f"class_name {CLASS}", extra.get("class_name") == CLASS),
            ('"corpusd_capture"', bool(extra.get("corpusd_capture"))),
        )
        if not ok
    ]  # fmt: skip
    if missing:
        raise EngineError(
            f"engine {engine.url} lacks the corpusd capture backend (no {', '.join(missing)}): "
            f"start it with {capture_flags(model=str(info.get('model_path') or 'MODEL_DIR'))}"
        )
    spool = Path(extra["corpusd_capture"])
    try:
        return info, EngineInfo.read(spool), spool
    except (OSError, ValueError, TypeError) as e:
        raise EngineError(
            f"engine {engine.url} captures into {spool}, which this process cannot read "
            f"({ENGINE_JSON}: {e}); run the pin on the server's host or share that directory"
        ) from None
