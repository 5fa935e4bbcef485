"""``corpusd pin``: pages equal the model's prefill, idempotence, atomicity, refusals."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from corpusd.cli import main as cli_main
from corpusd.corpus.ingest import CorpusError
from corpusd.corpus.layout import FILE_HEADER
from corpusd.corpus.pin import PinConfig, pin
from corpusd.corpus.store import PageStore, StoreError
from corpusd.model import KVCache, forward_tokens, load_model
from corpusd.tokenizer import ByteTokenizer, load_tokenizer


def _tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


FILES = {
    "src/b.py": b"def b():\n    return 2\n" * 12,
    "README.md": b"# sample\nA small corpus for tests.\n",
    "src/a.py": b"import os\nprint(os.getcwd())\n" * 9,
    "logo.png": b"\x89PNG\r\n\x1a\n\x00\x00binary",
}


def _pin(tmp: Path, tiny_dir: Path, corpus: Path, **kw: object):  # type: ignore[no-untyped-def]
    cfg = PinConfig(corpus=str(corpus), model=str(tiny_dir), store=str(tmp / "store"), **kw)  # type: ignore[arg-type]
    return pin(cfg, io.StringIO())


def _store_listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_pinned_pages_equal_the_models_prefill(tmp_path: Path, tiny_dir: Path, tiny_model) -> None:  # type: ignore[no-untyped-def]
    # This file's first 60 lines: real, varied text, past 2 × index_topk in BPE tokens too (its
    # whole source grew to ~6k tokens and this test to 79 s of CI; the count is asserted below).
    head = b"".join(Path(__file__).read_bytes().splitlines(keepends=True)[:60])
    files = {**FILES, "src/c.py": head}
    src = _tar(tmp_path / "repo.tar", files)
    r = _pin(tmp_path, tiny_dir, src, page_size=64, chunk=100)
    m = r.manifest
    assert not r.reused and m.state == "ready" and m.name == "repo"
    assert [f[0] for f in m.files] == ["README.md", "src/a.py", "src/b.py", "src/c.py"]
    assert [s[:2] for s in m.skipped] == [("logo.png", "binary")]
    store = PageStore(tmp_path / "store")
    tokens = store.read_tokens(m.corpus_id)
    # The stream: BOS, then each file's header + text; spans cover exactly those tokens.
    cfg = tiny_model.cfg
    assert int(tokens[0]) == cfg.bos_token_id and m.token_count == len(tokens)
    tok = load_tokenizer(tiny_dir, cfg.bos_token_id, cfg.eos_token_id)
    assert m.tokenizer == tok.name
    for path, start, end in m.files:
        text = (FILE_HEADER.format(path=path)).encode() + files[path]
        assert tok.decode(tokens[start:end].tolist()).encode() == text
    assert m.token_count > 2 * tiny_model.cfg.index_topk  # sparse selection happened during pin
    # Pages hold exactly what one monolithic prefill of the same tokens produces.
    cache = KVCache(tiny_model.cfg, m.token_count, torch.float32)
    forward_tokens(tiny_model, tokens.long(), cache, want_logits=False)
    pages = list(range(m.n_pages))
    for layer in range(m.n_layers):
        latent, index = store.read_pages(m.corpus_id, layer, pages)
        flat = latent.reshape(-1, m.kv_dim)
        assert torch.allclose(
            flat[: m.token_count], cache.latent[layer][: m.token_count], atol=1e-5
        )
        assert torch.all(flat[m.token_count :] == 0)
        assert torch.allclose(
            index.reshape(-1, m.index_dim)[: m.token_count],
            cache.index_keys[layer][: m.token_count],
            atol=1e-5,
        )
    # Random access to a subset of pages returns the same rows.
    sub, _ = store.read_pages(m.corpus_id, 1, [2, 0])
    full, _ = store.read_pages(m.corpus_id, 1, pages)
    assert torch.equal(sub[0], full[2]) and torch.equal(sub[1], full[0])
    store.verify(m.corpus_id)
    assert store.resolve("repo") == store.resolve(m.corpus_id[:8]) == m.corpus_id
    with pytest.raises(StoreError, match="no corpus named"):
        store.resolve("nope")
    with pytest.raises(StoreError, match="an id prefix needs at least 8 characters"):
        store.resolve(m.corpus_id[:6])
    with pytest.raises(StoreError, match="pages 0"):
        store.read_pages(m.corpus_id, 0, [m.n_pages])


def test_pinning_twice_gives_the_same_id_and_does_no_work(
    tmp_path: Path, tiny_dir: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    src = _tar(tmp_path / "repo.tar", FILES)
    first = _pin(tmp_path, tiny_dir, src)
    # Same content from a directory: same tokens, same id.
    d = tmp_path / "repo"
    for name, data in FILES.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    import corpusd.corpus.pin as pin_mod

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("prefill ran for an already pinned corpus")

    monkeypatch.setattr(pin_mod, "prefill", boom)
    monkeypatch.setattr(pin_mod, "load_model", boom)
    again = _pin(tmp_path, tiny_dir, src)
    from_dir = _pin(tmp_path, tiny_dir, d)
    assert again.reused and from_dir.reused
    assert again.manifest.corpus_id == from_dir.manifest.corpus_id == first.manifest.corpus_id
    # The same content under another --name is refused, not silently kept under the old one
    # (issue 19, defect 4: lookups by the new name failed); the same name is a plain re-pin.
    with pytest.raises(CorpusError, match=r"already pinned as 'repo' .* not --name 'renamed'"):
        _pin(tmp_path, tiny_dir, src, name="renamed")
    assert _pin(tmp_path, tiny_dir, src, name="repo").reused
    assert PageStore(tmp_path / "store").ids() == [first.manifest.corpus_id]
    # A different page size is a different corpus id (not reused).
    monkeypatch.undo()
    other = _pin(tmp_path, tiny_dir, src, page_size=32)
    assert other.manifest.corpus_id != first.manifest.corpus_id and not other.reused


def test_a_crash_mid_pin_leaves_nothing_visible(
    tmp_path: Path, tiny_dir: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    src = _tar(tmp_path / "repo.tar", FILES)
    from corpusd.corpus import store as store_mod

    real = store_mod.CorpusWriter.write_layer
    calls = []

    def dying(self, layer, *a, **k):  # type: ignore[no-untyped-def]
        calls.append(layer)
        if layer == 1:
            raise OSError("disk full (simulated)")
        return real(self, layer, *a, **k)

    monkeypatch.setattr(store_mod.CorpusWriter, "write_layer", dying)
    with pytest.raises(OSError, match="disk full"):
        _pin(tmp_path, tiny_dir, src)
    assert calls == [0, 1]
    store = PageStore(tmp_path / "store")
    assert store.ids() == [] and list(store.tmp.iterdir()) == []
    monkeypatch.undo()
    assert not _pin(tmp_path, tiny_dir, src).reused  # a retry succeeds


def test_a_killed_pin_process_leaves_nothing_visible(tmp_path: Path, tiny_dir: Path) -> None:
    """SIGKILL while writing pages: no corpus; the orphaned temp dir is swept on the next open."""
    body = b"x = 1\n" * 300
    src = _tar(tmp_path / "big.tar", {"big.py": body})
    store_dir = tmp_path / "store"
    code = (
        "import io, os, signal, sys\n"
        "from corpusd.corpus import store as s\n"
        "from corpusd.corpus.pin import PinConfig, pin\n"
        "real = s.CorpusWriter.write_layer\n"
        "def die(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "s.CorpusWriter.write_layer = die\n"
        f"pin(PinConfig(corpus={str(src)!r}, model={str(tiny_dir)!r}, store={str(store_dir)!r},"
        " max_tokens=10**6), io.StringIO())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert len(list((store_dir / "tmp").iterdir())) == 1  # the dead writer's temp dir
    store = PageStore(store_dir)
    assert store.ids() == [] and list(store.tmp.iterdir()) == []


def _special(name: str, kind: bytes, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


BAD_INPUTS = [
    ("abs.tar", {"/etc/passwd": b"root\n"}, "absolute"),
    ("dots.tar", {"a/../../x.py": b"x\n"}, r"'\.\.'"),
    ("empty.tar", {"img.bin": b"\x00\x01\x02"}, "no text files"),
    (
        "symlink.tar",
        {"ok.py": b"x\n", "ln": _special("ln", tarfile.SYMTYPE, "../../etc")},
        "outside the corpus root",
    ),
    (
        "hardlink.tar",
        {"ok.py": b"x\n", "hl": _special("hl", tarfile.LNKTYPE, "../x")},
        "outside the corpus root",
    ),
    (
        "device.tar",
        {"ok.py": b"x\n", "dev": _special("dev", tarfile.CHRTYPE)},
        "a character device",
    ),
    ("fifo.tar", {"ok.py": b"x\n", "p": _special("p", tarfile.FIFOTYPE)}, "a FIFO"),
]


@pytest.mark.parametrize(("name", "files", "message"), BAD_INPUTS)
def test_bad_corpora_are_refused_and_write_nothing(
    tmp_path: Path, tiny_dir: Path, name: str, files: dict[str, object], message: str
) -> None:
    src = tmp_path / name
    with tarfile.open(src, "w") as tar:
        for member, data in files.items():
            if isinstance(data, tarfile.TarInfo):
                tar.addfile(data)
            else:
                assert isinstance(data, bytes)
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with pytest.raises(CorpusError, match=message):
        _pin(tmp_path, tiny_dir, src)
    assert _store_listing(tmp_path / "store") == []


def test_corrupt_archive_and_token_limit_write_nothing(tmp_path: Path, tiny_dir: Path) -> None:
    good = _tar(tmp_path / "ok.tar", FILES)
    bad = tmp_path / "cut.tar"
    bad.write_bytes(good.read_bytes()[:700])
    with pytest.raises(CorpusError, match="corrupt"):
        _pin(tmp_path, tiny_dir, bad)
    cfg = load_model(tiny_dir).cfg
    tok = load_tokenizer(tiny_dir, cfg.bos_token_id, cfg.eos_token_id)
    readme = [FILE_HEADER.format(path="README.md"), FILES["README.md"].decode()]
    limit = 1 + sum(len(tok.encode(t)) for t in readme) + 1  # BOS, README.md, 1 of src/a.py
    with pytest.raises(CorpusError, match=rf"token limit of {limit} at file 'src/a\.py'"):
        _pin(tmp_path, tiny_dir, good, max_tokens=limit)
    assert _store_listing(tmp_path / "store") == []


def test_cli_pin_summary_and_errors(tmp_path: Path, tiny_dir: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    src = _tar(tmp_path / "repo.tar", FILES)
    args = ["pin", "--corpus", str(src), "--model", str(tiny_dir), "--store", str(tmp_path / "s")]
    assert cli_main(args) == 0
    out = capsys.readouterr()
    assert "pinned: repo" in out.out and "pages of 64" in out.out and "skipped: 1 binary" in out.out
    assert "prefill |" in out.err  # the progress bar
    assert cli_main(args) == 0
    assert "already pinned: repo" in capsys.readouterr().out
    assert (
        cli_main(["pin", "--corpus", str(tmp_path / "missing.tar"), "--model", str(tiny_dir)]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("corpusd: error: ") and "missing.tar" in err and err.count("\n") == 1
    assert cli_main(["pin", "--corpus", str(src), "--model", str(tmp_path)]) == 2
    assert "config.json not found" in capsys.readouterr().err
    assert (
        cli_main(["pin", "--corpus", str(src), "--page-size", "0", "--model", str(tiny_dir)]) == 2
    )
    assert "page_size must be > 0" in capsys.readouterr().err


def test_tokenizer_json_in_the_model_dir_is_used(
    tmp_path: Path, tiny_dir: Path, sglang_dir: Path
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from corpusd.tokenizer import HFTokenizer, load_tokenizer

    vocab = {"[UNK]": 0, "def": 1, "return": 2, "x": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    tok.save(str(model_dir / "tokenizer.json"))
    loaded = load_tokenizer(model_dir, bos_id=5, eos_id=6)
    assert isinstance(loaded, HFTokenizer) and loaded.bos_id == 5
    assert loaded.encode("def x return y") == [1, 3, 2, 0]
    assert isinstance(load_tokenizer(sglang_dir, 256, 257), ByteTokenizer)
    # The CPU default's BPE: far fewer tokens than bytes on source code, and lossless.
    bpe = load_tokenizer(tiny_dir, 0, 1)
    text = Path(__file__).read_text()
    ids = bpe.encode(text)
    assert isinstance(bpe, HFTokenizer) and len(ids) < len(text.encode()) / 3
    assert bpe.decode(ids) == text and max(ids) < 16384


def test_console_script_runs(tmp_path: Path, tiny_dir: Path) -> None:
    env = {**os.environ, "CORPUSD_HOME": str(tmp_path)}
    script = Path(sys.executable).parent / "corpusd"  # where pip put the console entry point
    out = subprocess.run([script, "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("corpusd ")
    model = load_model(tiny_dir)
    assert model.cfg.num_attention_heads == 64 and model.cfg.kv_dim == 576


def test_counts_in_summaries_read_as_numbers() -> None:
    """Issue 19: the pin summary said "1460 pages" beside "93,434" tokens, and "1 files"."""
    from corpusd.cli import count

    assert count(1, "file") == "1 file" and count(2, "file") == "2 files"
    assert count(1460, "page") == "1,460 pages" and count(0, "page") == "0 pages"


def test_every_flag_of_every_command_says_what_it_does() -> None:
    """Issue 19: the holder's flags showed only "(default: )", and agents --agents, --drain-s,
    calibrate --repeats and others had no help at all."""
    import argparse

    from corpusd.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [
        f"{name} {a.option_strings[0]}"
        for name, p in sub.choices.items()
        for a in p._actions
        if a.option_strings and a.dest != "help"
        if not a.help or a.help.lstrip().startswith("(default")
    ]
    assert not bare, f"flags without help: {bare}"


def test_detach_is_a_flag_and_still_takes_a_value() -> None:
    """Issue 19: ``corpusd up --detach`` needed a value."""
    from corpusd.cli import build_parser

    p = build_parser()
    assert p.parse_args(["up", "--detach"]).detach == 1
    assert p.parse_args(["up", "--detach", "1"]).detach == 1
    assert p.parse_args(["up", "--detach", "0"]).detach == 0
    assert p.parse_args(["up"]).detach == 0


def test_no_coordinator_reads_the_same_everywhere(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Issue 19: two wordings were used for "no coordinator"; status and agents now say the
    same line, and every --coordinator help says where its default comes from."""
    import argparse

    from corpusd import env
    from corpusd.cli import build_parser, main

    monkeypatch.setenv("CORPUSD_HOME", str(tmp_path))
    monkeypatch.delenv("CORPUSD_COORDINATOR", raising=False)
    for argv in (["status"], ["agents", "--corpus", "x"], ["unpin", "x"]):
        assert main(argv) == 2
        assert capsys.readouterr().err.strip() == f"corpusd: error: {env.NO_COORDINATOR}"
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = [
        (name, a.help or "")
        for name, p in sub.choices.items()
        for a in p._actions
        if "--coordinator" in a.option_strings
    ]
    found = {name for name, h in flags if "up.json" in h}  # the holder's registers nowhere
    want = {"pin", "demo", "status", "agent", "agents", "ls", "unpin", "rm", "ask"}
    assert found == want, flags  # by default
    assert not any(h.endswith("(default: )") for _, h in flags), flags


def test_a_model_path_from_the_environment_must_exist(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Issue 37: ``CORPUSD_MODEL=/nonexistent/m2 corpusd pin`` wrote a random model there and
    pinned with it. Now one line says so and nothing is written; ``model init`` makes one."""
    src = _tar(tmp_path / "repo.tar", FILES)
    missing = tmp_path / "nonexistent" / "m2"
    monkeypatch.setenv("CORPUSD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CORPUSD_MODEL", str(missing))
    args = ["pin", "--corpus", str(src), "--store", str(tmp_path / "s")]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("corpusd: error: $CORPUSD_MODEL=") and err.count("\n") == 1, err
    assert "does not exist" in err and f"corpusd model init {missing}" in err
    assert not missing.exists() and _store_listing(tmp_path / "s") in ([], ["corpora"])
    missing.mkdir(parents=True)  # a directory without a model is refused too
    assert cli_main(args) == 2 and "holds no model" in capsys.readouterr().err
    assert cli_main(["model", "init", str(missing)]) == 0
    capsys.readouterr()
    assert cli_main(args) == 0 and "pinned: repo" in capsys.readouterr().out
