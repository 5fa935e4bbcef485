"""``corpusd pin --engine`` against a real SGLang server (issue 18; ``pytest -m sglang``).

Server A runs with the capture backend; the test pins a text through ``--engine`` and holds the
stored pages to what A held, bit for bit, and to what a fresh server B is given back:

- The spool holds each page as A's host pool held it: SGLang's write-through copy of its device
  pool (``batch_set_v1``), copied out by :func:`corpusd.engine.spool.capture`, whose reading of
  every host layout is tested on CPU against pools shaped as SGLang's. Here every whole page of
  the pinned corpus, as the fetch backend hands it to a host pool
  (:meth:`CorpusPages.host_page`), must equal A's spooled bytes: latent rows and indexer pages.
- Server B, started fresh with the fetch backend (``corpusd_store`` = the pinned store), holds
  nothing, loads the corpus's whole pages from the store (``cached_tokens``, checked) and answers
  the same questions as A.

What this cannot check is A's and B's answers for equality: SGLang's NSA prefill is not
deterministic from one server to the next. Two fresh servers that prefill the same corpus hold
different bytes (an H200 run: layer 0 equal, layer 1 981 of 3,029 latent rows and 16 of 48
indexer pages different) and answer with log-probs ~0.001-0.01 apart, and SGLang 0.5.10 refuses
``--enable-deterministic-inference`` with ``--attention-backend nsa``. The strict xfail control
below measures that and turns into a failure the day it stops being true; then the answers can be
compared exactly again. A's and B's log-prob differences are printed.

- The corpus is longer than ``index_topk`` (2,048) so the index keys decide which corpus keys are
  attended (sparse regime), and is not a whole number of pages (the tail page is filled by the
  pin's decode steps and dropped).

Skipped with the reason without sglang or an SM90 GPU; it never runs in CPU CI.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from corpusd.cli import main as cli_main
from corpusd.corpus.layout import FILE_HEADER
from corpusd.corpus.store import PageStore
from corpusd.engine.spool import page_hashes, read_page
from corpusd.model import ModelConfig
from corpusd.model.tiny import init_tiny
from corpusd.tokenizer import load_tokenizer
from requester.sglang.pages import CorpusPages
from tests.support.checks import why_no_sglang_gpu
from tests.support.procwatch import Workers, descendants
from tools.sglang_server import SGLANG_ENV, sglang_flags

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(bool(why_no_sglang_gpu()), reason=why_no_sglang_gpu()),
]

ROOT = Path(__file__).resolve().parents[2]
PAGE, CORPUS_BYTES, NEW, TOP = 64, 3_000, 8, 5
#: a server is healthy once its own warm-up request (3 tokens) is answered: ~50 s on an H100
#: with SGLang's JIT kernels built (bench/results/logs/sglang-*-h100-route.log). On a bare
#: machine its first forward first builds them (tvm-ffi: ninja, nvcc; Triton: ptxas), silently,
#: one after another; that time is not counted against START_S but is capped by START_CAP_S.
#: Past either, the test dumps every server process's stack and fails, inside one 10-minute call
START_S, START_CAP_S = 240, 480
COMPILERS = (b"ninja", b"nvcc", b"cicc", b"ptxas", b"cudafe", b"fatbinary", b"nvlink", b"cc1plus")
QUESTIONS = ["\nQ: what does a holder own?\nA:", "\nQ: where are pages stored?\nA:"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(
        self, model: Path, log: Path, kv: str, extra: dict[str, Any], prefetch: str
    ) -> None:
        port = _free_port()
        # fp8: flashmla_kv prefill and decode (SGLang's flashmla_sparse decode cannot read its
        # fp8 cache; tools/sglang_server.py: sglang_flags)
        flags = [*sglang_flags(kv), "--model-path", str(model), "--port", str(port)]
        flags += [
            "--disable-cuda-graph", "--enable-hierarchical-cache",
            "--hicache-write-policy", "write_through", "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra),
            "--hicache-storage-prefetch-policy", prefetch,
            "--hicache-mem-layout", "layer_first", "--hicache-io-backend", "kernel",
            "--hicache-size", "2",
        ]  # fmt: skip
        # more SGLang flags for a run (e.g. --enable-deterministic-inference, for the control)
        flags += shlex.split(os.environ.get("CORPUSD_TEST_SGLANG_FLAGS", ""))
        self.url, self.log = f"http://127.0.0.1:{port}", log
        self._log = log.open("w")
        path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
        # faulthandler: a process that dies of a signal (or gets SIGABRT from wait) writes every
        # thread's Python stack into the log
        env = {**os.environ, **SGLANG_ENV, "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1"}
        cmd = [sys.executable, "-m", "sglang.launch_server", *flags]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = START_S, cap: float = START_CAP_S) -> None:
        """Until ``/health`` answers 200 (SGLang's warm-up request was answered): ``timeout``
        s not counting the time a compiler runs under the server, at most ``cap`` s in all.
        Fails at once when the server or one of its processes exits (a scheduler that dies of a
        signal takes no launcher down with it: SGLang would wait forever), and past the limits
        with every server thread's stack in the failure. ``self.jit_s``: the time compilers ran."""
        t0, last, workers = time.monotonic(), time.monotonic(), Workers(self.proc.pid)
        self.jit_s = 0.0
        while (now := time.monotonic()) - t0 - self.jit_s < timeout and now - t0 < cap:
            assert self.proc.poll() is None, f"sglang exited:\n{self.tail()}"
            if gone := workers.poll():
                time.sleep(2)  # let faulthandler's dump reach the log
                pytest.fail(f"sglang processes {gone} exited:\n{self.tail(200)}")
            if self._compiling():
                self.jit_s += now - last
            last = now
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        print(f"{self.log.name}: healthy in {now - t0:.0f} s, compilers ran "
                              f"{self.jit_s:.0f} s of it")  # fmt: skip
                        return
            except OSError:
                pass
            time.sleep(1)
        pytest.fail(
            f"sglang not healthy in {time.monotonic() - t0:.0f} s ({self.jit_s:.0f} s of it "
            f"compiling); its stacks:\n{self.stacks()}"
        )

    def _compiling(self) -> bool:
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                if any(c in Path(argv0.decode(errors="replace")).name.encode() for c in COMPILERS):
                    return True
        return False

    def stacks(self) -> str:
        """Where every server process is (py-spy when installed, else faulthandler's dump on
        SIGABRT, which ends the process), then the log's tail."""
        pids = [*descendants(self.proc.pid), self.proc.pid]
        dumps = ["== processes (a compiler here: the server is building a JIT kernel)"]
        for pid in pids:
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                dumps.append(f"{pid}: {cmd.decode(errors='replace')[:200]}")
        if spy := shutil.which("py-spy"):
            for pid in pids:
                r = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                                   text=True, timeout=60)  # fmt: skip
                dumps.append(f"== py-spy dump --pid {pid}\n{r.stdout}{r.stderr}")
        else:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGABRT)
            time.sleep(3)
        return "\n".join(dumps) + "\n" + self.tail(400)

    def tail(self, n: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def generate(self, ids: list[int]) -> dict[str, Any]:
        body = {
            "input_ids": ids, "return_logprob": True, "top_logprobs_num": TOP,
            "logprob_start_len": len(ids) - 1,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        }  # fmt: skip
        req = urllib.request.Request(
            self.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _backend(**kw: Any) -> dict[str, Any]:
    return {
        "backend_name": "corpusd", "module_path": "requester.sglang.hicache",
        "class_name": "CorpusdHiCacheStorage", "interface_v1": 1, **kw,
    }  # fmt: skip


def _corpus_dir(tmp_path: Path) -> tuple[Path, Any, Path]:
    """The tiny SGLang-shaped model, its tokenizer and a one-file corpus longer than the index's
    top-k with a partial last page."""
    model = init_tiny(tmp_path / "model", preset="sglang", index_topk=2048)
    mc = ModelConfig.from_dir(model)
    tok = load_tokenizer(model, mc.bos_token_id, mc.eos_token_id)
    text = (ROOT / "README.md").read_text()[:CORPUS_BYTES].rstrip("\n") + "\n"
    header = len(tok.encode(FILE_HEADER.format(path="notes.md"))) + (tok.bos_id is not None)
    if (header + len(tok.encode(text))) % PAGE == 0:  # keep a partial last page
        text = text[:-2] + "\n"
    src = tmp_path / "src"
    src.mkdir()
    (src / "notes.md").write_text(text)
    return model, tok, src


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_pages_pinned_through_sglang_are_what_sglang_holds(tmp_path: Path, kv: str) -> None:
    model, tok, src = _corpus_dir(tmp_path)
    store, spool = tmp_path / "store", tmp_path / "spool"
    # A as `corpusd pin --engine` tells users to start it (client.capture_flags: SGLang's default
    # prefetch policy, best_effort: a capture server has nothing to fetch, so no request waits on
    # its prefetch thread); B must load every stored page before prefilling, so wait_complete
    a = Server(model, tmp_path / "capture.log", kv, _backend(corpusd_capture=str(spool),
               model_path=str(model)), "best_effort")  # fmt: skip
    b = None
    try:
        a.wait()
        args = ["pin", "--corpus", str(src), "--model", str(model), "--store", str(store)]
        rc = cli_main([*args, "--engine", a.url, "--coordinator", "", "--name", "eng"])
        assert rc == 0, a.tail()
        ps = PageStore(store)
        m = ps.manifest(ps.resolve("eng"))
        want_kv = "fp8_e4m3" if kv == "fp8_e4m3" else "bfloat16"
        assert m.engine["kv_dtype"] == want_kv and m.engine["marker"].startswith("sglang-0.5")
        assert m.token_count > 2048 and m.token_count % PAGE, m.token_count
        b = Server(model, tmp_path / "fetch.log", kv, _backend(corpusd_store=str(store),
                   model_path=str(model)), "wait_complete")  # fmt: skip
        b.wait()
        corpus = ps.read_tokens(m.corpus_id).tolist()
        whole = m.token_count // PAGE * PAGE
        pages = CorpusPages(str(store), m.model_fingerprint)
        keys = page_hashes(corpus)
        assert len(keys) == whole // PAGE and all(k in pages for k in keys)
        layout = json.loads((spool / "engine.json").read_text())["layout"]
        host_dtype = torch.uint8 if kv == "fp8_e4m3" else torch.bfloat16
        for n, key in enumerate(keys):
            held_kv, held_index = read_page(spool, key)
            kv_page, index_pages = pages.host_page(key, layout, host_dtype)
            same_kv = torch.equal(held_kv.flatten().view(torch.uint8), kv_page.view(torch.uint8))
            assert same_kv, f"page {n}: latent rows differ from what A held"
            assert held_index is not None and len(index_pages) == len(held_index)
            for li, page in enumerate(index_pages):
                assert torch.equal(page, held_index[li]), f"page {n} layer {li}: indexer page"
        for q in QUESTIONS:
            prompt = corpus + tok.encode(q)
            ra, rb = a.generate(prompt), b.generate(prompt)
            ma, mb = ra["meta_info"], rb["meta_info"]
            assert ma["cached_tokens"] >= whole, f"A recomputed the corpus: {ma['cached_tokens']}"
            assert mb["cached_tokens"] >= whole, (
                f"B did not load the pinned pages ({mb['cached_tokens']} cached):\n{b.tail()}"
            )
            la = [x[0] for x in ma["output_token_logprobs"]]
            lb = [x[0] for x in mb["output_token_logprobs"]]
            print(f"{q!r}: A {ra['output_ids']} B {rb['output_ids']}; log-prob A - B "
                  f"{[round(x - y, 5) for x, y in zip(la, lb, strict=True)]}")  # fmt: skip
    finally:
        for s in (a, b):
            if s is not None:
                s.stop()


@pytest.mark.xfail(
    strict=True,
    reason="SGLang's NSA prefill is not deterministic across servers (module docstring); "
    "an XPASS means it is now, and the bit-for-bit test can compare answers exactly again",
)
def test_control_two_servers_compute_the_same_pages_and_log_probs(tmp_path: Path) -> None:
    """The premise of the bit-for-bit test: two fresh servers that compute the same corpus
    themselves (both capture servers, each pinned through) hold the same page bytes and answer a
    question after it with the same log-probs. A third server fed the first one's pinned pages
    is compared too. Every fact is printed (JSON) before anything is asserted, so one run says
    which of the three comparisons breaks."""
    model, tok, src = _corpus_dir(tmp_path)
    servers: dict[str, Server] = {}
    facts: dict[str, Any] = {}
    try:
        for name in ("a", "c"):  # started together: each takes --mem-fraction-static 0.3
            extra = _backend(corpusd_capture=str(tmp_path / f"spool-{name}"), model_path=str(model))
            servers[name] = Server(model, tmp_path / f"{name}.log", "auto", extra, "best_effort")
        stores = {}
        for name in ("a", "c"):
            servers[name].wait()
            stores[name] = PageStore(tmp_path / f"store-{name}")
            args = ["pin", "--corpus", str(src), "--model", str(model), "--store",
                    str(tmp_path / f"store-{name}"), "--engine", servers[name].url,
                    "--coordinator", "", "--name", "eng"]  # fmt: skip
            assert cli_main(args) == 0, servers[name].tail()
        ids = {n: s.resolve("eng") for n, s in stores.items()}
        m = stores["a"].manifest(ids["a"])
        facts["corpus_ids_equal"] = ids["a"] == ids["c"]
        differ, rows = [], []  # per layer: indexer pages, latent rows that differ
        for li in range(m.n_layers):
            pa, pc = (stores[n].read_index_pages(ids[n], li, range(m.n_pages)) for n in "ac")
            assert pa is not None and pc is not None
            differ.append(int((pa != pc).any(dim=-1).sum()))
            la, lc = (stores[n].read_pages(ids[n], li, range(m.n_pages))[0] for n in "ac")
            rows.append(int((la.view(torch.int16) != lc.view(torch.int16)).any(dim=-1).sum()))
        facts["index_pages_differing_per_layer"] = differ
        facts["latent_rows_differing_per_layer"] = rows
        extra = _backend(corpusd_store=str(tmp_path / "store-a"), model_path=str(model))
        servers["b"] = Server(model, tmp_path / "b.log", "auto", extra, "wait_complete")
        servers["b"].wait()
        corpus = stores["a"].read_tokens(ids["a"]).tolist()
        for q in QUESTIONS:
            out = {n: servers[n].generate(corpus + tok.encode(q))["meta_info"] for n in "acb"}
            facts[q] = {
                n: {"cached": o["cached_tokens"], "lp": [x[0] for x in o["output_token_logprobs"]]}
                for n, o in out.items()
            }
        print("CONTROL " + json.dumps(facts))
        assert not any(rows) and not any(differ), facts
        for q in QUESTIONS:
            assert facts[q]["a"]["lp"] == facts[q]["c"]["lp"], f"two fresh servers differ: {facts}"
            assert facts[q]["a"]["lp"] == facts[q]["b"]["lp"], f"pinned pages differ: {facts}"
    finally:
        for s in servers.values():
            s.stop()
