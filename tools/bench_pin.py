"""Pin throughput: a real ~200 KB source tar end to end, and tok/s at several corpus sizes.

Every pin is ``corpusd pin``'s own code (``corpusd.corpus.pin.pin``) in a fresh subprocess, so
peak memory is its own. Two measurements:

- ``tar``: the installed source of a real third-party package (default ``prometheus_client``,
  a corpusd dependency, ~200 KB), tarred as ``corpusd demo --package`` does, pinned with the
  default model: wall seconds (tokenize + load + prefill + write) and prefill tok/s. This is
  the README's first command.
- ``rows``: corpora of real source text (this Python's standard library, sorted) cut to about
  each target token count with the model's tokenizer: prefill tok/s, peak RSS (and peak GPU
  memory on CUDA), and the pin's FLOP model (indexer + sparse attention) against a compute
  floor: on CPU this machine's fp32 matmul rate measured in the same run; on an H100/H200 the
  tensor cores' dense peak (989 TFLOP/s bf16, twice that for an fp8 indexer). On CUDA each size
  is pinned ``--pin-reps`` times (default 3) in one process and the median prefill reported:
  SGLang's number is the median of repeats on a warm server, and a fresh process's first
  prefill also pays the GPU's clock ramp and the allocator's growth (``prefill_s_reps``).

``--profile`` first times the prefill's phases (indexer scores, top-k, projections, attention,
MLPs) over the tar's first ``--profile`` tokens. ``--device cuda[:N]`` runs the same code on a
GPU (default there: the SGLang-shaped preset in bf16, 8,192-token chunks, 16k/64k/256k tokens);
``--device cpu`` with the same flags exercises that path here. When a size is past the preset's
163,840 positions the bench's checkpoint gets more (``--positions``; the rope stays the
preset's), so 256k tokens run on both sides; with ``--positions 0`` such sizes are skipped.

``--sglang`` (GPU, sglang installed) then times stock SGLang's prefill of the same token ids on
the same checkpoint, one server started once after the pins (``tools/pin_sglang.py``), and
records corpusd tok/s over SGLang's per size. The checkpoint then has index_topk 2048 (SGLang's
NSA top-k kernels take only that) and index_arith fp8 (SGLang's indexer scores in fp8 whatever
the checkpoint says; ``--index-arith exact`` keeps bf16 scores), so its corpusd rows differ from
a run without the flag.

    python -m tools.bench_pin                       # CPU default: the tar, then 4k and 16k
    python -m tools.bench_pin --sizes 4096 --no-tar --out /tmp/pin.json
    python -m tools.bench_pin --device cuda:0       # GPU: writes bench/results/pin-<gpu>.json
    python -m tools.bench_pin --device cuda:0 --no-tar --sizes 16384 65536 131072 --sglang
Writes bench/results/pin-cpu.json (or pin-<gpu>.json; pin-<gpu>-sglang.json with --sglang).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from corpusd.formats import KERNELS
from corpusd.model import ModelConfig
from tools.pin_profile import profile


def matmul_gflops(device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """GEMM rate at the indexer's shape ([16384, 128] @ [128, 1024]) in ``dtype``, median of 9:
    fp32 on CPU (the torch scorer's), bf16 on CUDA (the Triton scorer's tensor-core operands)."""
    a = torch.randn(16384, 128, device=device).to(dtype)
    b = torch.randn(128, 1024, device=device).to(dtype)
    out = torch.empty(16384, 1024, device=device, dtype=dtype)
    times = []
    for _ in range(12):
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        if device != "cpu":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    times = sorted(times[3:])
    return 2 * 16384 * 128 * 1024 / times[len(times) // 2] / 1e9


def make_corpus(root: Path, tokens: int, model_dir: str | Path | None = None) -> None:
    """Copy stdlib ``*.py`` files (sorted) until they tokenize (with ``model_dir``'s tokenizer,
    bytes without one, as pin renders them) to about ``tokens``; the last file is cut to fit."""
    from corpusd.corpus.layout import FILE_HEADER
    from corpusd.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

    tok: Tokenizer = ByteTokenizer()
    if model_dir is not None:
        cfg = ModelConfig.from_dir(model_dir)
        tok = load_tokenizer(model_dir, cfg.bos_token_id, cfg.eos_token_id)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 1
    files = [f for f in sorted(stdlib.rglob("*.py")) if "test" not in f.relative_to(stdlib).parts]
    for i, f in enumerate(files):
        name = f.relative_to(stdlib).as_posix().replace("/", "_")
        text = f.read_text(encoding="utf-8", errors="replace")
        head = len(tok.encode(FILE_HEADER.format(path=name)))
        n = head + len(tok.encode(text + ("" if text.endswith("\n") else "\n")))
        if total + n > tokens:
            budget = tokens - total - head - 1
            if budget <= 0:
                break
            text = text[: max(1, len(text) * budget // n)]
            n = budget
        (root / f"{i:05d}_{name}").write_text(text, encoding="utf-8")
        total += n
        if total >= tokens - 1:
            break


def flop_model(cfg: ModelConfig, t: int, chunk: int) -> dict[str, float]:
    """FLOPs of pinning ``t`` tokens the way forward_tokens does (chunked, sparse)."""
    pairs = 0
    for start in range(0, t, chunk):
        n = min(chunk, t - start)
        if start + n > cfg.index_topk:
            pairs += n * (start + n)
    layers = cfg.num_hidden_layers
    indexer = 2.0 * pairs * cfg.index_n_heads * cfg.index_head_dim * layers
    attn = 2.0 * t * cfg.num_attention_heads * cfg.index_topk * (cfg.kv_dim + cfg.kv_lora_rank)
    return {"indexer": indexer, "attention": attn * layers}


def pin_once(
    corpus: str, model: str, device: str, chunk: int, dtype: str, ids_out: Path | None = None,
    kernels: str = "auto",
) -> dict[str, Any]:  # fmt: skip
    """One ``pin`` into a temporary store; its numbers. ``ids_out``: also write the pinned token
    ids there (a JSON list), for SGLang to prefill the same."""
    from corpusd.corpus.pin import PinConfig, pin
    from corpusd.corpus.store import PageStore

    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as quiet:
        if device != "cpu":
            torch.empty(1, device=device)  # a CUDA context first: the stats need one
            torch.cuda.reset_peak_memory_stats(torch.device(device))
        cfg = PinConfig(
            corpus=corpus, model=model, store=f"{tmp}/store", chunk=chunk, dtype=dtype,
            device=device, kernels=kernels,
        )  # fmt: skip
        r = pin(cfg, quiet)
        if ids_out is not None:
            ids = PageStore(f"{tmp}/store").read_tokens(r.path.name).tolist()
            ids_out.write_text(json.dumps(ids))
    m = r.manifest
    row: dict[str, Any] = {
        "tokens": m.token_count,
        "prefill_s": m.prefill_seconds,
        "pin_s": round(r.seconds, 3),
        "tok_per_s": round(m.token_count / m.prefill_seconds, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if device != "cpu":
        peak = torch.cuda.max_memory_allocated(torch.device(device))
        row["peak_gpu_mib"] = round(peak / (1 << 20), 1)
        from corpusd.model.prefill_kernels import choose

        mcfg = ModelConfig.from_dir(model)
        row["kernels"] = choose(mcfg, device, getattr(torch, dtype), kernels).describe
    return row


def run_size(
    tokens: int, model: str, device: str, chunk: int, dtype: str, ids_out: Path | None = None,
    kernels: str = "auto", reps: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Pin about ``tokens`` tokens ``reps`` times in this process, each into a fresh store; the
    row has the median prefill (every rep's too)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        make_corpus(src, tokens, model)
        runs = [pin_once(str(src), model, device, chunk, dtype, ids_out, kernels)]
        for _ in range(reps - 1):
            runs.append(pin_once(str(src), model, device, chunk, dtype, None, kernels))
    row = runs[0]
    if reps > 1:
        times = [r["prefill_s"] for r in runs]
        row["prefill_s_reps"] = times
        row["prefill_s"] = statistics.median(times)
        row["tok_per_s"] = round(row["tokens"] / row["prefill_s"], 1)
        row["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    flops = flop_model(ModelConfig.from_dir(model), row["tokens"], chunk)
    row["indexer_gflop"] = round(flops["indexer"] / 1e9, 1)
    row["attention_gflop"] = round(flops["attention"] / 1e9, 1)
    return row


def _child(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tools.bench_pin", *args], capture_output=True, text=True, env=env
    )
    if out.returncode:  # the child's own error, not only its exit status
        raise SystemExit(f"bench_pin {' '.join(args)} failed:\n{out.stderr[-4000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def bench_positions(preset: str, sizes: list[int], flag: int) -> int | None:
    """The max_position_embeddings the bench's checkpoint needs for ``sizes`` (None: the
    preset's). The rope stays the preset's (YaRN, factor 40 over 4,096): a throughput bench of
    a random-weight model, which corpusd and SGLang then load alike, not a longer-context model."""
    from corpusd.model.tiny import preset_config
    from tools.pin_sglang import HEADROOM

    have = preset_config(preset).max_position_embeddings
    if flag > 0:
        return flag
    if flag == 0 or max(sizes) <= have:
        return None
    return -(-(max(sizes) + HEADROOM) // 4096) * 4096


def vs_sglang(
    a: argparse.Namespace, model: Path, by_size: dict[int, dict[str, Any]], positions: int,
    ids_dir: Path, out: Path,
) -> dict[str, Any]:  # fmt: skip
    """Stock SGLang's prefill of each pinned size's ids (tools/pin_sglang.py) and the ratios."""
    from tools.pin_sglang import compare, run_sglang

    ids = {
        size: json.loads((ids_dir / f"{size}.json").read_text())
        for size, row in by_size.items()
        if "skipped" not in row
    }
    for size, got in ids.items():
        assert len(got) == by_size[size]["tokens"], f"{size=}: {len(got)=} is not the pin's count"
    log = out.with_suffix(".sglang.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    sg = run_sglang(model, ids, positions, a.sglang_port, log, a.sglang_reps) if ids else {}
    return {"sglang": sg, "comparison": compare(by_size, sg)}


#: dense bf16 tensor-core peak (TFLOP/s), vendors' data sheets (SXM); fp8 is twice it
PEAK_BF16_TFLOPS = {"h100": 989.0, "h200": 989.0}


def device_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((g for g in ("h200", "h100", "a100", "l40s") if g in name), "cuda")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--preset", choices=("cpu", "sglang"), help="default: cpu (sglang on CUDA)")
    p.add_argument("--sizes", type=int, nargs="+", help="default: 4096 16384 (CUDA: 16k 64k 256k)")
    p.add_argument("--chunk", type=int, help="prefill chunk (default: 256; CUDA: 8192)")
    p.add_argument("--dtype", help="cache and model dtype (default: float32; CUDA: bfloat16)")
    p.add_argument("--package", default="prometheus_client", help="the tar: this package's source")
    p.add_argument("--no-tar", action="store_true", help="skip the tar")
    p.add_argument("--profile", type=int, default=0, help="time the phases over N tar tokens")
    p.add_argument(
        "--kernels", default="auto", choices=KERNELS,
        help="the pin's prefill kernels (corpusd pin --kernels): auto or the torch references",
    )  # fmt: skip
    p.add_argument("--out", help="default: bench/results/pin-<device>[-sglang].json")
    p.add_argument(
        "--positions", type=int, default=-1,
        help="the checkpoint's max_position_embeddings: -1 (default) raises the preset's to the "
        "largest size rounded up to 4,096 when it is short; 0 keeps the preset's",
    )  # fmt: skip
    p.add_argument(
        "--sglang", action="store_true",
        help="also time stock SGLang's prefill of the same ids (GPU, sglang installed)",
    )  # fmt: skip
    p.add_argument(
        "--index-topk", type=int, default=0,
        help="the checkpoint's index_topk (default: the preset's; 2048 with --sglang)",
    )  # fmt: skip
    p.add_argument(
        "--index-arith", choices=("exact", "fp8"),
        help="the checkpoint's index_arith (default: the preset's; fp8, SGLang's own indexer "
        "arithmetic, with --sglang)",
    )  # fmt: skip
    p.add_argument(
        "--pin-reps", type=int, default=0,
        help="pins per size, in one process, median reported (default: 3 on CUDA, as SGLang's "
        "prefill is the median of repeats on a warm server; 1 on CPU)",
    )  # fmt: skip
    p.add_argument("--sglang-port", type=int, default=30124)
    p.add_argument("--sglang-reps", type=int, default=0, help="default: 5 to 32k tokens, else 3")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    cuda = a.device != "cpu"
    chunk = a.chunk or (8192 if cuda else 256)
    dtype = a.dtype or ("bfloat16" if cuda else "float32")
    if a.one:  # a child: one pin, its row as the last line of stdout
        model = os.environ["BENCH_MODEL"]
        if a.one == "profile":
            row = profile(
                os.environ["BENCH_TAR"], model, a.profile, chunk, a.device, dtype, a.kernels
            )
        elif a.one == "tar":
            row = pin_once(os.environ["BENCH_TAR"], model, a.device, chunk, dtype, None, a.kernels)
        else:
            ids = Path(os.environ["BENCH_IDS"]) / f"{a.one}.json" if a.sglang else None
            reps = a.pin_reps or (3 if cuda else 1)
            row = run_size(int(a.one), model, a.device, chunk, dtype, ids, a.kernels, reps)
        print(json.dumps(row))
        return
    preset = a.preset or ("sglang" if cuda else "cpu")
    if a.sglang and preset != "sglang":
        p.error("--sglang needs --preset sglang: SGLang's NSA kernels take its 64 x 128 indexer")
    sizes = a.sizes or ([16384, 65536, 262144] if cuda else [4096, 16384])
    from corpusd.corpus.pin import sample_repo
    from corpusd.model.tiny import init_tiny
    from tools.pin_sglang import SGLANG_TOPK, positions_skip

    common = ["--device", a.device, "--chunk", str(chunk), "--dtype", dtype]
    common += ["--kernels", a.kernels]
    common += ["--sglang"] if a.sglang else []
    common += ["--pin-reps", str(a.pin_reps)] if a.pin_reps else []
    result: dict[str, Any] = {
        "what": f"corpusd pin, tiny model ({preset} preset), {a.device}, {dtype}; "
        "tok/s = tokens / prefill s",
        "command": "python -m tools.bench_pin " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
            "device": device_name(a.device),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "preset": preset,
        "chunk": chunk,
        "dtype": dtype,
        "kernels": a.kernels,
        "load_avg_before": [round(x, 2) for x in os.getloadavg()],
    }
    with tempfile.TemporaryDirectory() as tmp:
        overrides: dict[str, Any] = {"index_topk": SGLANG_TOPK} if a.sglang else {}
        if a.index_topk:
            if a.sglang and a.index_topk != SGLANG_TOPK:
                p.error(f"--sglang needs index_topk {SGLANG_TOPK} (SGLang's NSA top-k kernels)")
            overrides["index_topk"] = a.index_topk
        arith = a.index_arith or ("fp8" if a.sglang else None)
        if arith:  # SGLang's NSA indexer always scores in fp8: so, with --sglang, does the pin
            overrides["index_arith"] = arith
        raised = bench_positions(preset, sizes, a.positions)
        if raised is not None:  # the preset's 163,840 positions stop short of 256k tokens
            overrides["max_position_embeddings"] = raised
            result["max_position_embeddings_raised_to"] = raised
        model_dir = init_tiny(Path(tmp) / "model", preset=preset, **overrides)
        positions = ModelConfig.from_dir(model_dir).max_position_embeddings
        bench_cfg = ModelConfig.from_dir(model_dir)
        result["index_topk"] = bench_cfg.index_topk  # SGLang's with --sglang
        result["index_arith"] = bench_cfg.index_arith
        (Path(tmp) / "ids").mkdir()
        env = {**os.environ, "BENCH_MODEL": str(model_dir), "CORPUSD_HOME": tmp}
        env["BENCH_IDS"] = str(Path(tmp) / "ids")
        if not a.no_tar or a.profile:
            os.environ["CORPUSD_HOME"] = tmp
            tar = sample_repo(a.package)
            env["BENCH_TAR"] = str(tar)
            result["tar"] = {"package": a.package, "bytes": tar.stat().st_size}
            if a.profile:
                phases = _child(["--one", "profile", "--profile", str(a.profile), *common], env)
                result["profile"] = phases
                total = phases["prefill (total)"]
                print(f"prefill phases over {phases['tokens']:,} tokens ({total:.1f} s):")
                for k, v in sorted(phases.items(), key=lambda kv: -kv[1]):
                    if k not in ("tokens", "threads", "prefill (total)"):
                        print(f"  {k:36s} {v:8.2f} s  {100 * v / total:5.1f} %")
            if not a.no_tar:
                row = _child(["--one", "tar", *common], env)
                result["tar"].update(row)
                print(f"tar {a.package} ({tar.stat().st_size:,} bytes): {json.dumps(row)}")
        mm_dtype = torch.bfloat16 if cuda and dtype == "bfloat16" else torch.float32
        gflops = matmul_gflops(a.device, mm_dtype)
        mm_name = "bf16" if mm_dtype == torch.bfloat16 else "fp32"
        result[f"matmul_{mm_name}_gflops"] = round(gflops, 1)
        rows, by_size = [], {}
        for size in sizes:
            skip = positions_skip(size, positions)
            if skip is not None:  # both sides: neither model can hold it
                by_size[size] = {"size": size, **skip}
                print(f"{size:,}: skipped: {skip['reason']}", file=sys.stderr)
                continue
            row = _child(["--one", str(size), *common], env)
            floor = (row["indexer_gflop"] + row["attention_gflop"]) / gflops
            peak = PEAK_BF16_TFLOPS.get(result["machine"]["device"]) if cuda else None
            if peak:  # the tensor cores' floor, not a torch GEMM's rate
                index_peak = peak * (2 if result["index_arith"] == "fp8" else 1)
                floor = row["indexer_gflop"] / index_peak / 1e3
                floor += row["attention_gflop"] / peak / 1e3
            row["compute_floor_s"] = round(floor, 2)
            row["of_floor"] = round(floor / row["prefill_s"], 2)
            rows.append(row)
            by_size[size] = row
            print(json.dumps(row), file=sys.stderr)
        result["rows"] = rows
        result["skipped"] = [r for r in by_size.values() if "skipped" in r]
        out = Path(a.out or f"bench/results/pin-{device_name(a.device)}"
                   f"{'-sglang' if a.sglang else ''}.json")  # fmt: skip
        if a.sglang:  # the pins' rows first: a run cut short by a time limit keeps them
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
            result.update(vs_sglang(a, model_dir, by_size, positions, Path(tmp) / "ids", out))
    result["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"\nmatmul {mm_dtype}: {gflops:.1f} GFLOP/s ({result['machine']['device']})")
    head = ("tokens", "prefill s", "tok/s", "peak RSS", "indexer GF", "attn GF", "floor/act")
    print(" ".join(f"{h:>10}" for h in head))
    for r in rows:
        cells = (
            f"{r['tokens']:,}",
            f"{r['prefill_s']:.1f}",
            f"{r['tok_per_s']:,.0f}",
            f"{r['peak_rss_mib']:,.0f}Mi",
            f"{r['indexer_gflop']:,.0f}",
            f"{r['attention_gflop']:,.0f}",
            f"{r['of_floor']:.2f}",
        )
        print(" ".join(f"{c:>10}" for c in cells))
    for r in result.get("comparison", {}).get("rows", []):
        c, s = (f"{v:,.0f}" if v else "-" for v in (r["corpusd_tok_per_s"], r["sglang_tok_per_s"]))
        tail = f"ratio {r['ratio']:.2f}" if r["ratio"] is not None else f"({r['why']})"
        print(f"{r['size']:>10,}  corpusd {c:>9}  SGLang {s:>9} tok/s  {tail}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if a.sglang:
        from tools.pin_sglang import failures

        if failures(result["sglang"]):  # the JSON keeps what was measured; the exit says not all
            sys.exit("SGLang: " + "; ".join(failures(result["sglang"]))[:2000])


if __name__ == "__main__":
    main()
