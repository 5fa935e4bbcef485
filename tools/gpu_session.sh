#!/usr/bin/env bash
# The GPU runs the open issues wait for, one named step per device call (each fits the device
# tool's 10-minute call), results and logs under $OUT (at most 8 files come back a call).
# Run from the repo root on an offline H100/H200 host with .sglang-deps carried:
#   bash tools/gpu_session.sh fanin          # issue 21: bench_fanin, --spread speed then page (~4 min)
#   bash tools/gpu_session.sh decode         # issue 17: stock vs graphed route, 8 and 64 streams (~4 min)
#   bash tools/gpu_session.sh decode-engine  # the same over a corpus pinned through SGLang (~5 min)
#   bash tools/gpu_session.sh bad-binding    # issue 17: the pytest -m sglang bad-input test (~5 min)
#   bash tools/gpu_session.sh predicate      # issue 17: forced route, forced fetch and auto, host path,
#                                            #   8 teacher-forced steps a request = 64 (~9 min)
#   bash tools/gpu_session.sh device-tests   # pytest -m gpu tests/gpu, then the device-path tests (~5 min)
#   bash tools/gpu_session.sh ttft           # issue 17: first token under 64 arrivals, per prefill (~3 min)
#   bash tools/gpu_session.sh layer          # issue 17: the corpus path per layer, top-k variants (~2 min)
#   bash tools/gpu_session.sh pin-check      # issue 18: GPU pin + kernel tests, index-score launch sweep (~3 min)
#   bash tools/gpu_session.sh pin            # issue 18: bench_pin --sglang, corpusd vs SGLang prefill (~6 min)
#   bash tools/gpu_session.sh engine-pin     # issue 18: engine pins = the server's page bytes (~6 min;
#                                            #   its strict-xfail control, ~4 min: pytest -k control)
#   bash tools/gpu_session.sh engine-agree   # issue 18: route on engine-true pages vs stock, fitted (~9 min)
#   bash tools/gpu_session.sh fp8            # issue 18: fp8 GPU tests, then bench_sglang on fp8 (~8 min)
#   bash tools/gpu_session.sh diag-layer     # issue 36: layer-by-layer diff, stock vs route, on the
#                                            #   held-out-like 128-head x 4-layer random model (~5 min)
#   bash tools/gpu_session.sh diag-floor     # issue 36: route vs stock beside stock's own noise floor,
#                                            #   the same model (~5 min; reuses diag-layer's pin when warm);
#                                            #   DIAG_MODES (default stock,route; route+one: the one-call
#                                            #   variant too), DIAG_PORT, DIAG_INDEX_HEADS (32, 64
#                                            #   or 128: SGLang's fp8 indexer), DIAG_INDEX_TIES=all
#                                            #   (zero index weights: every row's cut is one tie)
#   bash tools/gpu_session.sh span           # issue 36: a span-fitted checkpoint (fit_tiny --task span)
#                                            #   then route vs stock and both floors over the standard
#                                            #   library with span questions; SPAN_GEOMETRY=g64x2 |
#                                            #   g128x4 | g64x8; SPAN_PHASE=fit then bench (two calls,
#                                            #   ~9 min each) or both (one call, a 3-min fit);
#                                            #   SPAN_PORT, SPAN_BENCH_S: the bench's port, limit;
#                                            #   SPAN_FIT_ARGS: fit_tiny flags (default: the
#                                            #   curriculum in the step, copy steps to gap 1800);
#                                            #   ROUTE_TRIALS: fresh route servers teacher-forced (3)
#   bash tools/gpu_session.sh span-all       # issue 36: span with every geometry (or SPAN_GEOMETRY's,
#                                            #   space-separated) at once on the one GPU:
#                                            #   SPAN_PHASE=fit (7-min fits, ~9 min) then =bench (stock,
#                                            #   route, route+one and both floors each; SPAN_MODES); three
#                                            #   benches at once finish one route trial in a call, so for
#                                            #   3 trials bench one geometry a call (span, SPAN_GEOMETRY)
#   bash tools/gpu_session.sh install        # only install the carried deps into /tmp/site
#   bash tools/gpu_session.sh copy           # issue 36, 2 GPUs: copying by content (tools/copy_sanity)
#                                            #   on g64x2 (GPU 0) and g128x4 (GPU 1), COPY_STEPS each,
#                                            #   then a 1-minute span fit's step rate (~4 min)
#   bash tools/gpu_session.sh pair-step      # issue 35, 2 GPUs, .corpusd-deps + .gpu-deps carried: the
#                                            #   FlashMLA kernel tests (topk_length too), then the
#                                            #   distributed decode step alone (bench_gpu pair --quick
#                                            #   --step-only: variants, phases, compacted split, at
#                                            #   STEP_AGENTS agents, default 32,64,128,256; ~2 min)
#   bash tools/gpu_session.sh failover       # issue 35: the pytest -m sglang device-path failover test,
#                                            #   a holder SIGKILLed under 32 streams (~5 min)
#   bash tools/gpu_session.sh peer-tests     # issue 35, 2 GPUs, .gpu-deps carried: the peer-pool GPU test
#                                            #   (a holder on GPU 1 read from GPU 0), then pytest -m gpu (~4 min)
#   bash tools/gpu_session.sh peer-read      # issue 35, 2 GPUs, .corpusd-deps + .gpu-deps carried: a pool
#                                            #   on GPU 1 read from GPU 0 in place against staged
#                                            #   (tools/bench_peer_read), then the peer-pool GPU test,
#                                            #   in place and staged (~3 min)
#   bash tools/gpu_session.sh peer           # issue 35, 2 GPUs: stock vs graphed route with the holders on
#                                            #   GPU 1 (PEER_HOLDERS), the corpus split over two, 8 and 64
#                                            #   streams, 4 bursts (the first is warm-up) (~6 min)
#   bash tools/gpu_session.sh dp             # issue 35, 2 GPUs: stock vs route under --tp 2 --dp 2
#                                            #   --enable-dp-attention, a holder on each GPU, the corpus
#                                            #   split over both, teacher-forced beside both floors (~8 min);
#                                            #   DECODE_MODES=stock,route,route+one ROUTE_TRIALS=2: the
#                                            #   one-call variant beside route (decode, peer, dp)
#   bash tools/gpu_session.sh share          # issue 35: equal-HBM bench, 2 workers + holder on one GPU;
#                                            #   SHARE_FRACTIONS=0.5 then 0.25,1,2 in two calls (~6-9 min each);
#                                            #   on 4 GPUs: SHARE_SERVERS=4 SHARE_ARGS="--gpus 4" (one
#                                            #   holder copy on GPU 0, read by the others over peer access)
#                                            #   or SHARE_ARGS="--gpus 4 --spread" (the one copy split
#                                            #   over a holder on each GPU); --pin-engine: the corpus
#                                            #   pinned through SGLang (stock's own pages);
#                                            #   --route-alt-env CORPUSD_SGLANG_STAGE_ROWS=0: corpusd
#                                            #   again with the peer rows read in place, one run
# Steps on one warm machine share /tmp/site (installed once). Each step prints a short summary last.
set -uo pipefail
step=${1:?"a step: fanin | decode | decode-engine | bad-binding | predicate | device-tests | ttft | layer | pin-check | pin | engine-pin | engine-agree | fp8 | diag-layer | diag-floor | span | span-all | install | copy | pair-step | failover | peer-tests | peer-read | peer | dp | share"}
case "$step" in fanin|decode|decode-engine|bad-binding|predicate|device-tests|ttft|layer|pin-check|pin|engine-pin|engine-agree|fp8|diag-layer|diag-floor|span|span-all|install|copy|pair-step|failover|peer-tests|peer-read|peer|dp|share) ;;
    *) echo "unknown step $step: see the header of $0" >&2
       exit 2 ;;
esac
if [ "$step" = span ] || [ "$step" = span-all ]; then  # its settings are checked before anything is installed
    case "${SPAN_PHASE:-both}" in fit|bench|both) ;;
        *) echo "SPAN_PHASE=$SPAN_PHASE: fit, bench or both" >&2; exit 2 ;; esac
    for g in ${SPAN_GEOMETRY:-g64x2}; do
        case "$g" in g64x2|g128x4|g64x8) ;;
            *) echo "SPAN_GEOMETRY=$SPAN_GEOMETRY: g64x2, g128x4 or g64x8 (span-all: any of them, space-separated)" >&2; exit 2 ;; esac
    done
    if [ "$step" = span ] && [ "$(echo ${SPAN_GEOMETRY:-g64x2} | wc -w)" != 1 ]; then
        echo "SPAN_GEOMETRY=$SPAN_GEOMETRY: span takes one geometry; span-all takes several" >&2; exit 2
    fi
fi
case "${DIAG_INDEX_TIES:-}" in ""|all) ;; *) echo "DIAG_INDEX_TIES=$DIAG_INDEX_TIES: all or unset" >&2; exit 2 ;; esac
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if [ -d .sglang-deps/whl ] && [ ! -f /tmp/site/.corpusd-installed ]; then  # carried this call
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .sglang-deps/whl/*.whl && touch /tmp/site/.corpusd-installed
fi
# the daemons' gRPC (the image's grpcio is older than corpusd/v1 needs): tools/corpusd_deps.sh
if [ -d .corpusd-deps/whl ] && [ ! -f /tmp/site/.corpusd-daemon-deps ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade \
        .corpusd-deps/whl/*.whl && touch /tmp/site/.corpusd-daemon-deps
fi
export PYTHONPATH=/tmp/site:$PWD
# outputs are named by the card that ran them (a call for an H100 may get an H200)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE "h100|h200|a100|b200" | tr A-Z a-z)
GPU=${GPU:-gpu}
t0=$(date +%s)
took() { echo "$1: rc=$2 after $(( $(date +%s) - t0 )) s"; }
decode_run() {  # name [--pin-engine]: stock vs graphed route, 8 and 64 streams, twice each;
    # DECODE_MODES (default stock,route; stock,route,route+one adds the one-call variant)
    local name=$1; shift
    timeout 580 python3 -m tools.bench_sglang --modes "${DECODE_MODES:-stock,route}" \
        --regimes sparse --requests 8 \
        --tokens 16 --forced-steps 8 --streams 8,64 --graph-bs 8,64 --holder-device cuda:0 \
        --bursts 2 --first-token-reps 8 "$@" \
        --fit-steps 0 --work "/tmp/bsg-$step" --out "$OUT/$name-$GPU.json" \
        > "$OUT/$name-$GPU.log" 2>&1
    took "$step" $?
    cp "/tmp/bsg-$step/sglang-route.log" "$OUT/$name-$GPU-route.log" 2>/dev/null
    cp "/tmp/bsg-$step/sglang-stock.log" "$OUT/$name-$GPU-stock.log" 2>/dev/null
    tail -12 "$OUT/$name-$GPU.log"
}

# DIAG_INDEX_HEADS (default 64): the indexer's heads. 8 (× 128) puts exact ties at the top-k
# cut on CPU (scores of 0 after the ReLU), but SGLang 0.5.10 prefills only 32, 64 or 128 (DeepGEMM's fp8_mqa_logits: 128 % h == 0 and
# 4 % (128 / h) == 0); at 8 its scheduler died on that assertion (logs/sglang-floor-128h-i8-h200.log).
# DIAG_INDEX_TIES=all zeroes every indexer's weights_proj: every index score is then +0.0 in any
# arithmetic, every decode row past 2,048 keys is cut inside one tie, and the selection is the
# tie rule alone (stock's radix select keeps the tied keys whose atomics arrive first; route the
# lowest positions: requester/sglang/topk.py)
DIAG_INDEX_HEADS=${DIAG_INDEX_HEADS:-64}
DIAG_INDEX_TIES=${DIAG_INDEX_TIES:-}
D36=/tmp/d36; [ "$DIAG_INDEX_HEADS" = 64 ] || D36=/tmp/d36-i$DIAG_INDEX_HEADS
DIAG_NAME=sglang-floor-128h; [ "$DIAG_INDEX_HEADS" = 64 ] || DIAG_NAME=$DIAG_NAME-i$DIAG_INDEX_HEADS
[ -z "$DIAG_INDEX_TIES" ] || { D36=$D36-ties; DIAG_NAME=$DIAG_NAME-ties; }
diag_model() {  # 128 heads, 4 layers, hidden 1024, q LoRA 384, seed 20261127, random weights
    python3 - "$D36" "$DIAG_INDEX_HEADS" "$DIAG_INDEX_TIES" <<'PY'
import sys
from pathlib import Path
import torch
from corpusd.model.checkpoint import save_checkpoint
from corpusd.model.mla import Indexer
from corpusd.model.tiny import build_tiny
from corpusd.testing.span_qa import stdlib_corpus
d, index_heads, ties = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if not (d / "model/config.json").exists():  # what init_tiny writes (the sglang preset: no tokenizer)
    model = build_tiny(20261127, "sglang", num_attention_heads=128, num_hidden_layers=4,
                       hidden_size=1024, q_lora_rank=384, index_topk=2048,
                       mlp_layer_types=("dense", "sparse", "sparse", "sparse"), index_arith="fp8",
                       index_n_heads=index_heads)
    if ties == "all":  # the same weights, every indexer's head weights zero
        zeroed = [m.weights_proj.weight.data.zero_() for m in model.modules() if isinstance(m, Indexer)]
        assert len(zeroed) == 4, len(zeroed)
    save_checkpoint(model, d / "model", dtype=torch.bfloat16)
stdlib_corpus(d / "src", 3683)
PY
}
span_model() {  # geometry: its random init under /tmp/span36/<geometry>/init (rope 64 throughout)
    python3 - "$1" <<'PY'
import sys
from pathlib import Path
from corpusd.model.tiny import init_tiny
g = sys.argv[1]
geometries = {  # the sglang preset (64 heads, 2 layers, hidden 256) and two others
    "g64x2": {},
    "g128x4": dict(num_attention_heads=128, num_hidden_layers=4, hidden_size=1024,
                   q_lora_rank=384, mlp_layer_types=("dense",) + ("sparse",) * 3),
    "g64x8": dict(num_hidden_layers=8, hidden_size=512, q_lora_rank=256, first_k_dense_replace=2,
                  mlp_layer_types=("dense",) * 2 + ("sparse",) * 6),
}
if g not in geometries:
    sys.exit(f"SPAN_GEOMETRY={g}: one of {', '.join(geometries)}")
out = Path(f"/tmp/span36/{g}/init")
if not (out / "config.json").exists():
    init_tiny(out, seed=20261128, preset="sglang", index_topk=2048, index_arith="fp8",
              **geometries[g])
PY
}

SPAN_CURRICULUM="--batch 16 --lr 1e-3 --copy-warmup 3000 --copy-every 4 --copy-max-gap 1800"
SPAN_CURRICULUM="$SPAN_CURRICULUM --repeat-frac 0.25 --cipher-frac 0.5"
#: g64x8 answered loops of blanks or one letter after two 7-minute fits (batch 2 at lr 3e-3,
#: 388 steps: 3 of 8 answers corpus-dependent; the copy curriculum at batch 4, 419 steps
#: sharing the GPU: 0 of 8); 4 minutes alone at this (1,200 steps)
#: answered every question differently, each changing without the corpus
#: (span-fit-g64x8-lr3e-3-h200.json)
SPAN_G64X8="--batch 4 --lr 3e-3 --cipher-frac 0.5 --repeat-frac 0.25"
span_fit() {  # geometry minutes: fit_tiny --task span from its init, unless fitted already
    local g=$1 d=/tmp/span36/$1 curriculum=$SPAN_CURRICULUM
    [ "$1" = g64x8 ] && curriculum=$SPAN_G64X8
    if [ ! -f "$d/model/fit.json" ]; then
        timeout $(( $2 * 60 + 90 )) python3 -m tools.fit_tiny --src "$d/init" \
            --out "$d/model" --task span --steps 100000 --minutes "$2" --seq-len 2048 \
            --batch 2 --device cuda:0 --log-every 250 ${SPAN_FIT_ARGS-$curriculum} \
            > "$OUT/span-fit-$g-$GPU.log" 2>&1
        took "fit $g" $?
    fi
    cp "$d/model/fit.json" "$OUT/span-fit-$g-$GPU.json" 2>/dev/null
}
span_summary() {  # geometry: what the fit's own span eval found (fit.json)
    python3 - "$1" "/tmp/span36/$1/model/fit.json" <<'PY'
import json, sys
from pathlib import Path
p = Path(sys.argv[2])
s = json.loads(p.read_text()).get("span") if p.exists() else None
print(sys.argv[1], "no fit.json" if s is None else {k: s[k] for k in (
    "answered_exactly", "corpus_dependent", "distinct", "mean_right_chars")})
PY
}
span_bench() {  # geometry port limit: route (and SPAN_MODES' others) vs stock and both floors
    local g=$1 d=/tmp/span36/$1
    timeout "$3" python3 -m tools.bench_sglang --port "$2" \
        --modes "${SPAN_MODES:-stock,route,route+one}" --regimes sparse --requests 8 --tokens 16 \
        --forced-steps 8 --streams 8 --bursts 1 --first-token-reps 1 --holder-device cuda:0 \
        --pin-engine --dump --no-cuda-graph --src-model "$d/model" --corpus stdlib \
        --questions span --route-trials "${ROUTE_TRIALS:-3}" --work "$d/bench" \
        --out "$OUT/sglang-span-$g-$GPU.json" > "$OUT/sglang-span-$g-$GPU.log" 2>&1
    took "bench_sglang span $g" $?
}

case "$step" in
fanin)
    for spread in speed page; do
        timeout 150 python3 -m tools.bench_fanin --holders 2 --cpus-per-holder 4 --spread "$spread" \
            --baseline-s 15 --continued-s 40 --settle-s 8 --max-wait-s 45 --plot none \
            --out "$OUT/fanin-replicas-16core-$spread.json" --work "/tmp/fanin-$spread" \
            > "$OUT/fanin-16core-$spread.log" 2>&1
        took "fanin --spread $spread" $?
        grep -E "recovered|per holder, continued" "$OUT/fanin-16core-$spread.log"
    done ;;
decode)
    decode_run sglang-graphs64 ;;
decode-engine)  # the corpus pinned through SGLang (its own page bytes)
    decode_run sglang-graphs64-engine --pin-engine ;;
bad-binding)
    timeout 560 python3 -m pytest -x -q -s -m sglang tests/sglang/test_sglang_bad_binding.py \
        --basetemp=/tmp/bb > "$OUT/bad-binding.log" 2>&1
    took bad-binding $?
    cp /tmp/bb/*/probe.json "$OUT/bad-binding-probe.json" 2>/dev/null
    cp /tmp/bb/*/work/sglang-route.log "$OUT/bad-binding-route-server.log" 2>/dev/null
    tail -5 "$OUT/bad-binding.log" ;;
predicate)  # the JSON is saved after every mode, so a cut-short run keeps what it measured
    timeout 570 python3 -m tools.bench_sglang --modes stock,route --primitive route,fetch,auto \
        --regimes sparse --requests 8 --tokens 16 --forced-steps 8 --streams 8 --graph-bs 8 \
        --holder-device cuda:0 --fit-steps 0 --work /tmp/bsp --out "$OUT/sglang-predicate64-$GPU.json" \
        > "$OUT/sglang-predicate64-$GPU.log" 2>&1
    took predicate $?
    tail -14 "$OUT/sglang-predicate64-$GPU.log" ;;
device-tests)  # after a change to the kernels or the device path that CPU CI cannot run
    timeout 330 python3 -m pytest -q -rs -m gpu tests/gpu > "$OUT/gpu-kernel-tests.log" 2>&1
    took "pytest -m gpu tests/gpu" $?
    tail -2 "$OUT/gpu-kernel-tests.log"
    timeout 200 python3 -m pytest -q -m sglang tests/sglang/test_sglang_device_gpu.py \
        > "$OUT/device-path-gpu-tests.log" 2>&1
    took "device-path tests" $?
    tail -2 "$OUT/device-path-gpu-tests.log" ;;
ttft)
    timeout 400 python3 -m tools.diag_route_ttft --work /tmp/dtt --out "$OUT/route-ttft-$GPU.json" \
        > "$OUT/route-ttft-$GPU.log" 2>&1
    took ttft $?
    cp /tmp/dtt/sglang-route.log "$OUT/route-ttft-$GPU-route.log" 2>/dev/null
    tail -8 "$OUT/route-ttft-$GPU.log" ;;
layer)
    timeout 300 python3 -m tools.bench_device_path --variants \
        --out "$OUT/sglang-device-path-$GPU.json" > "$OUT/sglang-device-path-$GPU.log" 2>&1
    took layer $?
    tail -12 "$OUT/sglang-device-path-$GPU.log" ;;
pin-check)
    timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_gpu_pin.py tests/gpu/test_gpu_kernels.py \
        > "$OUT/pin-gpu-tests.log" 2>&1
    took "gpu pin + kernel tests" $?
    tail -3 "$OUT/pin-gpu-tests.log"
    timeout 200 python3 -m tools.bench_index_scores --sweep 65536 --sweep-arith fp8 \
        --out "$OUT/index-scores-$GPU.json" \
        > "$OUT/index-scores-$GPU.log" 2>&1
    took "index scores" $?
    grep -v '^{"keys' "$OUT/index-scores-$GPU.log" | tail -14 ;;
pin)
    timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_gpu_pin.py > "$OUT/pin-gpu-tests.log" 2>&1
    took "gpu pin tests" $?
    tail -2 "$OUT/pin-gpu-tests.log"
    timeout 460 python3 -m tools.bench_pin --device cuda:0 --no-tar --sizes 16384 65536 262144 --profile 262144 \
        --sglang --out "$OUT/pin-$GPU-sglang.json" > "$OUT/pin-$GPU-sglang.log" 2>&1
    took pin $?
    tail -12 "$OUT/pin-$GPU-sglang.log" ;;
engine-pin)
    timeout 570 python3 -m pytest -x -q -s -m sglang tests/sglang/test_engine_pin_gpu.py \
        -k "not control" --basetemp=/tmp/ep > "$OUT/engine-pin.log" 2>&1
    took engine-pin $?
    find /tmp/ep -name "*.log" -size -16M | head -4 | while read -r f; do cp "$f" "$OUT/"; done
    tail -8 "$OUT/engine-pin.log" ;;
engine-agree)  # the fitted model stays in /tmp/bse: a second call on a warm machine resumes
    timeout 570 python3 -m tools.bench_sglang --pin-engine --modes stock,route \
        --regimes dense,sparse --requests 8 --tokens 16 --forced-steps 16 --streams 8 \
        --graph-bs 8 --holder-device cuda:0 --fit-steps 2000 --work /tmp/bse \
        --out "$OUT/sglang-engine-pages-$GPU.json" > "$OUT/sglang-engine-pages-$GPU.log" 2>&1
    took engine-agree $?
    cp /tmp/bse/sglang-capture.log "$OUT/" 2>/dev/null
    tail -14 "$OUT/sglang-engine-pages-$GPU.log" ;;
fp8)
    timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py > "$OUT/fp8-gpu-tests.log" 2>&1
    took "fp8 gpu tests" $?
    tail -3 "$OUT/fp8-gpu-tests.log"
    timeout 350 python3 -m tools.bench_sglang --kv-cache-dtype fp8_e4m3 --modes stock,route \
        --regimes sparse --requests 8 --tokens 16 --forced-steps 4 --streams 8 --graph-bs 8 \
        --holder-device cuda:0 --fit-steps 0 --work /tmp/corpusd-bench-fp8 \
        --out "$OUT/sglang-fp8-$GPU.json" > "$OUT/sglang-fp8-$GPU.log" 2>&1
    took "fp8 bench" $?
    grep "^holders:" "$OUT/sglang-fp8-$GPU.log"; tail -10 "$OUT/sglang-fp8-$GPU.log" ;;
diag-layer)
    diag_model
    timeout 570 python3 -m tools.diag_layer_diff --model "$D36/model" --corpus-dir "$D36/src" \
        --holder-device cuda:0 --requests 4 --steps 4 --pin-engine --work "$D36/diag" \
        --out "$OUT/diag-layer-diff-$GPU.json" > "$OUT/diag-layer-diff-$GPU.log" 2>&1
    took diag_layer_diff $?
    cp "$D36"/diag/*.log "$OUT/" 2>/dev/null
    tail -15 "$OUT/diag-layer-diff-$GPU.log" ;;
diag-floor)
    diag_model
    timeout 570 python3 -m tools.bench_sglang --modes "${DIAG_MODES:-stock,route}" \
        --port "${DIAG_PORT:-30123}" --regimes sparse --requests 8 \
        --tokens 16 --forced-steps 8 --holder-device cuda:0 --pin-engine --dump --no-cuda-graph \
        --fit-steps 0 --work "$D36" --out "$OUT/$DIAG_NAME-$GPU.json" \
        > "$OUT/$DIAG_NAME-$GPU.log" 2>&1
    took "bench_sglang floor" $?
    tail -16 "$OUT/$DIAG_NAME-$GPU.log" ;;
span|span-all)  # issue 36 item 2: fitted so that answers depend on the corpus (fit.json says
    # whether they copy it). The default curriculum (docs/sglang.md, "Answers that depend on the
    # corpus"): copy steps at the questions' distances (--copy-max-gap) at the warm-up's
    # learning rate, kept up through the fit, and enciphered sequences a fit cannot answer from
    # memory. SPAN_PHASE=fit (up to SPAN_FIT_MINUTES, default 8) then =bench, two calls on one
    # warm machine; the default, both, fits 3 minutes and benches in one call. span-all: every
    # geometry at once on the one GPU (fits of SPAN_FIT_MINUTES, default 7; benches on ports
    # 30123, 30223, 30323), each bench's modes SPAN_MODES (default stock,route,route+one)
    phase=${SPAN_PHASE:-both}
    if [ "$step" = span ]; then
        geoms=${SPAN_GEOMETRY:-g64x2}; minutes=3; [ "$phase" = fit ] && minutes=${SPAN_FIT_MINUTES:-8}
    else  # three fits share one GPU's memory: at --batch 16 and the copy steps' 64 sequences
        # of up to 1,865 tokens they needed 28 + 47 + 63 GB and ran out (1 x H200)
        geoms=${SPAN_GEOMETRY:-g64x2 g128x4 g64x8}; minutes=${SPAN_FIT_MINUTES:-7}
        SPAN_CURRICULUM="$SPAN_CURRICULUM --batch 4 --copy-batch 8 --copy-warmup 1000"
        export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    fi
    for g in $geoms; do span_model "$g" || exit 2; done
    if [ "$phase" != bench ]; then
        for g in $geoms; do span_fit "$g" "$minutes" & done
        wait
        for g in $geoms; do tail -6 "$OUT/span-fit-$g-$GPU.log"; done
        for g in $geoms; do span_summary "$g"; done
    fi
    [ "$phase" = fit ] && exit 0
    limit=$([ "$phase" = both ] && echo 330 || echo "${SPAN_BENCH_S:-570}")
    port=${SPAN_PORT:-30123}
    for g in $geoms; do
        span_bench "$g" "$port" "$limit" &
        port=$(( port + 100 ))
    done
    wait
    for g in $geoms; do tail -24 "$OUT/sglang-span-$g-$GPU.log" | grep -E "over floor|top-k|bar|answers|forced|servers"; done ;;
install)
    echo "installed into /tmp/site: $(ls /tmp/site | wc -l) entries" ;;
copy)  # does copying by content form, and after how many steps, at the fits' settings on a GPU
    span_model g64x2 && span_model g128x4 || exit 2
    n=${COPY_STEPS:-3000}
    for pair in 0:g64x2 1:g128x4; do
        d=${pair%%:*}; g=${pair#*:}
        timeout 200 python3 -m tools.copy_sanity --src "/tmp/span36/$g/init" --steps "$n" \
            --batch 64 --lr "${COPY_LR:-1e-3}" --device "cuda:$d" \
            --out "$OUT/copy-sanity-$g-$GPU.json" > "$OUT/copy-sanity-$g-$GPU.log" 2>&1 &
    done
    wait
    took copy_sanity $?
    timeout 100 python3 -m tools.fit_tiny --src /tmp/span36/g64x2/init --out /tmp/span36/rate \
        --task span --steps 100000 --minutes 1 --seq-len 2048 --batch 16 --device cuda:0 \
        --log-every 50 > "$OUT/fit-rate-g64x2-$GPU.log" 2>&1
    took "fit rate" $?
    for g in g64x2 g128x4; do tail -4 "$OUT/copy-sanity-$g-$GPU.log" | cut -c1-300; done
    tail -5 "$OUT/fit-rate-g64x2-$GPU.log" ;;
pair-step)  # FlashMLA from .gpu-deps; NVSHMEM from the image's wheel
    export PYTHONPATH=$PYTHONPATH:$PWD/.gpu-deps/site
    # the compacted half's kernel (FlashMLA told each row's count) against the reference first
    timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_gpu_kernels.py -k flashmla \
        > "$OUT/gpu-kernels-flashmla-$GPU.log" 2>&1
    took "flashmla kernel tests" $?
    tail -3 "$OUT/gpu-kernels-flashmla-$GPU.log"
    timeout 300 python3 -m tools.bench_gpu pair --quick --step-only \
        --step-agents "${STEP_AGENTS:-32,64,128,256}" \
        --out "$OUT/gpu-pair-step-$GPU.json" > "$OUT/gpu-pair-step-$GPU.log" 2>&1
    took "pair --step-only" $?
    grep -E "^decode step|^graphed step|^compacted|^agents|^ +[0-9]+ " "$OUT/gpu-pair-step-$GPU.log" ;;
failover)
    timeout 570 python3 -m pytest -x -q -s -m sglang tests/sglang/test_sglang_device_failover.py \
        --basetemp=/tmp/fo > "$OUT/sglang-failover-test-$GPU.log" 2>&1
    took failover $?
    # (pytest also links the latest tmp dir as *current: take the numbered one)
    cp /tmp/fo/*0/failover.json "$OUT/sglang-failover-$GPU.json" 2>/dev/null
    cp /tmp/fo/*0/work/sglang-route.log "$OUT/sglang-failover-route-$GPU.log" 2>/dev/null
    tail -25 "$OUT/sglang-failover-test-$GPU.log" ;;
peer-tests)  # FlashMLA from .gpu-deps (no sglang needed); the daemons' gRPC from .corpusd-deps
    export PYTHONPATH=$PYTHONPATH:$PWD/.gpu-deps/site
    timeout 240 python3 -m pytest -q -s -rs tests/gpu/test_gpu_peer_pool.py \
        > "$OUT/peer-pool-test-$GPU.log" 2>&1
    took "peer-pool test" $?
    tail -6 "$OUT/peer-pool-test-$GPU.log"
    timeout 300 python3 -m pytest -q -rs -m gpu tests/gpu > "$OUT/pytest-gpu-$GPU-x2.log" 2>&1
    took "pytest -m gpu tests/gpu" $?
    tail -4 "$OUT/pytest-gpu-$GPU-x2.log" ;;
peer-read)  # FlashMLA from .gpu-deps; the daemons' gRPC (the test's holders) from .corpusd-deps
    export PYTHONPATH=$PYTHONPATH:$PWD/.gpu-deps/site
    for h in 128 64; do  # the share bench's heads, then the peer decode run's
        timeout 200 python3 -m tools.bench_peer_read --heads $h --out "$OUT/peer-read-h$h-$GPU.json" \
            > "$OUT/peer-read-h$h-$GPU.log" 2>&1
        took "bench_peer_read --heads $h" $?
    done
    timeout 240 python3 -m pytest -q -s -rs tests/gpu/test_gpu_peer_pool.py \
        > "$OUT/peer-pool-test-$GPU.log" 2>&1
    took "peer-pool test, in place and staged" $?
    grep -E "corpus path per layer|passed|failed" "$OUT/peer-pool-test-$GPU.log" | tail -3
    tail -4 "$OUT/peer-read-h128-$GPU.log" "$OUT/peer-read-h64-$GPU.log" ;;
peer)  # the server on GPU 0 reads the holders' pools on PEER_HOLDERS over NVLink, split over two
    decode_run "sglang-peer-${PEER_NAME:-gpu1}" --holder-device "${PEER_HOLDERS:-cuda:1}" \
        --holder-capacity 2048 --bursts 4 --first-token-reps 4 --route-trials "${ROUTE_TRIALS:-3}"
    grep -h "holder pools mapped" "/tmp/bsg-$step/sglang-route.log" | tail -1
    grep -ho "route (device path[^)]*)" "/tmp/bsg-$step/sglang-route.log" | tail -1 ;;
dp)  # each DP rank is a requester of its own over the one pinned copy (own GPU's pages by IPC)
    decode_run sglang-dp2 --holder-device cuda:0,cuda:1 --holder-capacity 2048 --bursts 4 \
        --first-token-reps 4 --sglang-extra "--tp 2 --dp 2 --enable-dp-attention" \
        --route-trials "${ROUTE_TRIALS:-3}"
    grep -h "holder pools mapped" "/tmp/bsg-$step/sglang-route.log" | tail -2 ;;
share)  # the model and pin stay in /tmp/bsh: the second call on a warm machine reuses the model
    fr=${SHARE_FRACTIONS:-0.5}; SHARE_ARGS=${SHARE_ARGS:-}
    timeout 580 python3 -m tools.bench_share --servers "${SHARE_SERVERS:-2}" --fractions "$fr" \
        --work /tmp/bsh $SHARE_ARGS \
        --out "$OUT/share-$GPU-${fr//,/_}.json" > "$OUT/share-$GPU-${fr//,/_}.log" 2>&1
    took share $?
    cp /tmp/bsh/sglang-route-*-0.log "$OUT/" 2>/dev/null
    tail -12 "$OUT/share-$GPU-${fr//,/_}.log" ;;
esac
