#!/usr/bin/env bash
# Builds .corpusd-deps/whl (~8 MB, git-ignored): the wheels corpusd's daemons need on the offline
# GPU hosts beyond their image and .sglang-deps: grpcio 1.85.1 (the image has 1.84, and the
# generated code in corpusd/v1 refuses older runtimes), grpcio-health-checking, protobuf 7.35.1,
# msgpack. uvloop is left out (asyncio's loop serves without it) to keep a call with
# .sglang-deps under the device tool's 64 MiB. tools/gpu_session.sh installs them when present.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.corpusd-deps/' .git/info/exclude 2>/dev/null || echo '/.corpusd-deps/' >> .git/info/exclude
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --no-deps -d .corpusd-deps/whl \
    grpcio==1.85.1 grpcio-health-checking==1.85.1 protobuf==7.35.1 'msgpack>=1.0'
du -sh .corpusd-deps
