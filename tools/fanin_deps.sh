#!/usr/bin/env bash
# Wheels tools/bench_fanin.py needs on an offline Python 3.12 host with torch preinstalled (the
# device machines): what its processes import at run time beyond torch and the standard library,
# as measured with PYTHONPROFILEIMPORTTIME=1 over a short run (bench, coordinator and holder logs):
#   grpcio, grpcio-health-checking, protobuf  the daemons' gRPC (corpusd/v1 needs >= 1.85.1 / 7.35.1)
#   uvloop                                    the daemons' event loop (asyncio's serves without it)
#   prometheus-client                         every daemon's /metrics (the bench scrapes fan-in there)
#   safetensors, numpy                        the page store (corpusd/corpus/store.py); saving a
#                                             tensor (the tiny model, the synthetic corpus) goes
#                                             through numpy in safetensors.torch
# Not brought: matplotlib (the plot is optional: without it the JSON and table are still written);
# tqdm, certifi, grpcio-tools (imported only when present, by torch.hub, site and grpc).
# Checked by a short run in a venv that sees only torch (and its own requirements) and these. Usage, from the repo root:  bash tools/fanin_deps.sh   → .fanin-deps/whl/*.whl
# On the host:  python3 -m pip install -q --no-index --no-deps --target /tmp/site .fanin-deps/whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
out=.fanin-deps/whl
mkdir -p "$out"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --no-deps -d "$out" \
    grpcio==1.85.1 grpcio-health-checking==1.85.1 protobuf==7.35.1 \
    'uvloop>=0.19' 'prometheus-client>=0.20' 'safetensors>=0.4' 'numpy>=1.24'
ls -l "$out"
du -sh "$out"
