"""Stock SGLang against route, layer by layer, on the same teacher-forced rows (issue 36, item 3).

Starts corpusd (coordinator, holders; the corpus pinned, by SGLang itself with
``--pin-engine``), then two servers one after the other, each recording every forward's last
rows per layer (``CORPUSD_SGLANG_DUMP``, ``requester/sglang/dump.py``):

- stock, through ``SGLANG_EXTERNAL_MODEL_PACKAGE=requester.sglang.stockdump`` (SGLang's own
  model class with hooks, the corpus in the prompt);
- route, the plugin (``requester.sglang``; only the question in the prompt).

Each question is answered greedily by stock, then both servers are teacher-forced on stock's
answer (one prefill per step, ``max_new_tokens`` 1, requests named ``diag-s<step>-q<req>-``),
and the rows are compared per layer (``tools/layer_compare.py``): the indexer's selected set
(overlap, margin at the cut where they differ, exact ties), the index scores, the attention
output, the hidden state. The report names, per row, the first layer and component where the
two part, and the log-prob difference of the next token there.

    python -m tools.diag_layer_diff --model /path/to/checkpoint --corpus-dir /path/to/text \
        --out bench/results/diag-layer-diff.json

The servers run without CUDA graphs (hooks do not run inside a replayed graph); the plugin's
path is the device path unless ``--path host``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from corpusd.tokenizer import ByteTokenizer
from requester.sglang import dump
from tools.layer_compare import compare_records, pair, report_lines, selection_agreement, tag
from tools.sglang_compare import vectors
from tools.sglang_server import Corpusd, Server, request, start_pinned

QUESTIONS = [
    "What does the first function return?",
    "Which names are imported at the top?",
    "What is raised when the input is empty?",
    "Where is the second class defined?",
]
CORPUS = "diag"


def forced_rows(
    server: Server, mode: str, prompts: list[list[int]], answers: list[list[int]], steps: int,
    vocab: int,
) -> list[list[list[float]]]:  # fmt: skip
    """One request at a time (one row per forward): for each question ``q`` and step ``s`` the
    prompt plus ``s`` answer tokens, named :func:`tools.layer_compare.tag`; the next-token
    log-softmax of each."""
    out = []
    for q, (p, ans) in enumerate(zip(prompts, answers, strict=True)):
        row = []
        for s in range(min(steps, len(ans))):
            body = request(p + ans[:s], 1, mode, CORPUS, q, vocab, True, tag(s, q))
            if mode == "stock":  # route's rid carries the tag through request(); stock's here
                body["rid"] = f"{tag(s, q)}{time.monotonic_ns()}"
            row.append(vectors(server.post(body)["meta_info"], vocab)[0])
        out.append(row)
    return out


def serve(
    a: argparse.Namespace, mode: str, model: Path, cd: Corpusd, out: Path, env: dict[str, str]
) -> Server:
    shutil.rmtree(out, ignore_errors=True)
    env = {**env, dump.ENV_DUMP: str(out)}
    log = Path(a.work) / f"diag-{mode}.log"
    server = Server(mode, model, a.port, cd, log, (), a.kv_cache_dtype, extra_env=env)
    server.wait()
    return server


def run(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(a.model)
    cfg = json.loads((model / "config.json").read_text())
    vocab, k = int(cfg["vocab_size"]), int(cfg["index_topk"])
    sources = {CORPUS: Path(a.corpus_dir)} if a.corpus_dir else None
    corpora = {CORPUS: (a.corpus_bytes, "README.md")}
    cd = start_pinned(work, model, corpora, a.holders, a.holder_device, a.kv_cache_dtype,
                      a.port + 7 if a.pin_engine else 0, sources)  # fmt: skip
    tok = ByteTokenizer()
    suffixes = [tok.encode(f"\n\nQ: {q}\nA:") for q in QUESTIONS[: a.requests]]
    corpus = cd.tokens[CORPUS]
    forced: dict[str, list[list[list[float]]]] = {}
    try:
        stock = serve(a, "stock", model, cd, work / "dump-stock",
                      {"SGLANG_EXTERNAL_MODEL_PACKAGE": "requester.sglang.stockdump"})  # fmt: skip
        try:
            prompts = [corpus + s for s in suffixes]
            answers = [
                stock.post(request(p, a.steps, "stock", CORPUS, i, vocab, False))["output_ids"]
                for i, p in enumerate(prompts)
            ]
            forced["stock"] = forced_rows(stock, "stock", prompts, answers, a.steps, vocab)
        finally:
            stock.stop()
        route_env = {"CORPUSD_SGLANG_PATH": a.path} if a.path else {}
        route = serve(a, "route", model, cd, work / "dump-route", route_env)
        try:
            forced["route"] = forced_rows(route, "route", suffixes, answers, a.steps, vocab)
        finally:
            route.stop()
    finally:
        cd.stop()
    return summarize(
        dump.load(work / "dump-stock"), dump.load(work / "dump-route"), forced, k,
        {"model": str(model), "corpus_tokens": len(corpus), "index_topk": k, "answers": answers},
    )  # fmt: skip


def summarize(
    stock: list[dict[str, Any]], route: list[dict[str, Any]],
    forced: dict[str, list[list[list[float]]]], k: int, meta: dict[str, Any],
    tol: dict[str, float] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The per-row comparison (keyed ``s<step>q<request>``), each row's next-token |Δ log-prob|
    (max over the vocabulary entries above −30 in both), the per-layer selection agreement, and
    the first parting over all rows (the lowest layer, then the earliest component)."""
    rows: dict[str, Any] = {}
    for (s, q), a, b in pair(stock, route):
        row = compare_records(a, b, k, tol)
        va, vb = forced["stock"][q][s], forced["route"][q][s]
        d = [abs(x - y) for x, y in zip(va, vb, strict=True) if x > -30 and y > -30]
        row["next_token_logprob_max_abs_diff"] = max(d) if d else None
        rows[f"s{s}q{q}"] = row
    partings = [r["first_parting"] for r in rows.values() if r["first_parting"] is not None]
    order = {c: i for i, c in enumerate(("scores", "selection", "attn", "hidden"))}
    first = min(partings, key=lambda p: (p["layer"], order[p["component"]]), default=None)
    return {
        **meta,
        "rows_compared": len(rows),
        "rows_parted": len(partings),
        "first_parting": first,
        "selection_agreement": selection_agreement(list(rows.values())),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json + weights)")
    ap.add_argument("--corpus-dir", default="", help="text to pin (default: this repo's text)")
    ap.add_argument("--corpus-bytes", type=int, default=3600, help="bytes of this repo's text")
    ap.add_argument("--work", default="/tmp/corpusd-diag-layer-diff")
    ap.add_argument("--out", default="bench/results/diag-layer-diff.json")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="teacher-forced steps per request")
    ap.add_argument("--holders", type=int, default=2)
    ap.add_argument("--holder-device", default="cuda")
    ap.add_argument("--port", type=int, default=30223)
    ap.add_argument("--path", choices=("", "device", "host"), default="",
                    help="the plugin's path (default: its own choice)")  # fmt: skip
    ap.add_argument("--pin-engine", action="store_true",
                    help="pin through a stock SGLang server in capture mode")  # fmt: skip
    ap.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16", "fp8_e4m3"), default="auto")
    a = ap.parse_args(argv)
    out = run(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    for line in report_lines(out["rows"]):
        print(line)
    print(f"first parting over {out['rows_compared']} rows: {out['first_parting']}")
    print(f"selection agreement per layer: {json.dumps(out['selection_agreement'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
