"""Test helpers: a pinned corpus and real ``corpusd holder`` processes on loopback."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from corpusd.corpus.pin import PinConfig, pin
from holder.launch import HolderProcess
from holder.launch import start_holder as _start


def pin_sample(
    tmp: Path, model_dir: Path, tokens: int = 1000, dtype: str = "float32", kv_format: str = "plain"
) -> str:
    """Pin ~``tokens`` byte tokens of text into ``tmp/store`` (cache in ``dtype``, latent rows in
    ``kv_format``); returns the corpus id."""
    body = "".join(f"line {i}: the quick brown fox {i * 7919 % 1000}\n" for i in range(tokens))[
        :tokens
    ]
    src = tmp / "repo.tar"
    with tarfile.open(src, "w") as tar:
        info = tarfile.TarInfo("src/main.txt")
        data = body.encode()
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    r = pin(
        PinConfig(
            corpus=str(src),
            model=str(model_dir),
            store=str(tmp / "store"),
            dtype=dtype,
            kv_format=kv_format,
        ),
        io.StringIO(),
    )
    return r.manifest.corpus_id


def start_holder(
    store: Path, state_dir: Path, model_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> HolderProcess:
    return _start(store, state_dir, model_dir, "--threads", "1", *extra, env=env)
