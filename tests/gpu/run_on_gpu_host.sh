#!/usr/bin/env bash
# tests/gpu on a GPU host with the host's own python and torch: no virtualenv, no index there.
#
#   tests/gpu/run_on_gpu_host.sh build   here (with a package index): our dependencies, torch
#                                        excepted, as wheels in tests/gpu/.wheelhouse
#   tests/gpu/run_on_gpu_host.sh run     there, from a copy of the repository and its wheelhouse:
#                                        the wheels of what the host's python lacks go into a
#                                        private --target directory on PYTHONPATH, then
#                                        `pytest tests/gpu` runs (at most GPU_TEST_TIMEOUT s)
#   tests/gpu/run_on_gpu_host.sh         both (build unless the wheelhouse is there)
#
# Without an NVIDIA GPU (or without torch, or CUDA) the tests skip, each saying why, and the run
# passes: that is what a host without a GPU can check. A single GPU runs test_one_gpu.py;
# test_gpu_e2e.py (NCCL across a GPU pair) needs two. Settings (environment):
#   PYTHON=python3            the host's interpreter (3.11+), the one with torch
#   GPU_PY_VERSIONS="3.11 3.12 3.13"   interpreters the wheelhouse serves (binary wheels differ)
#   GPU_TEST_TIMEOUT=280      seconds pytest may run
#   GPU_DEPS_DIR=$TMPDIR/...  where the missing wheels are installed (made 0700, ours)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
wheelhouse="$here/.wheelhouse"
PYTHON="${PYTHON:-python3}"
GPU_PY_VERSIONS="${GPU_PY_VERSIONS:-3.11 3.12 3.13}"
GPU_TEST_TIMEOUT="${GPU_TEST_TIMEOUT:-280}"

# import name -> requirement: what gelastic needs at run time on a GPU node, and what the tests
# need; torch is the host's own.
REQUIREMENTS=(
    "grpc=grpcio>=1.85.1"
    "grpc_health=grpcio-health-checking>=1.85.1"
    "grpc_reflection=grpcio-reflection>=1.85.1"
    "google.protobuf=protobuf>=7.35"
    "psutil=psutil>=5.9"
    "prometheus_client=prometheus-client>=0.20"
    "aiohttp=aiohttp>=3.9"
    "pynvml=nvidia-ml-py>=12"
    "pytest=pytest>=8"
    "pytest_asyncio=pytest-asyncio>=0.23"
    "pytest_timeout=pytest-timeout>=2.3"
    "hypothesis=hypothesis>=6.100"
)

requirements() { for r in "${REQUIREMENTS[@]}"; do echo "${r#*=}"; done; }

build() {
    local pip="${BUILD_PYTHON:-$repo/.venv/bin/python}"
    [ -x "$pip" ] || pip="$PYTHON"
    rm -rf "$wheelhouse.tmp"
    mkdir -p "$wheelhouse.tmp"
    local got=0
    for v in $GPU_PY_VERSIONS; do
        # Binary wheels only, for that interpreter on x86_64 Linux; a version the index cannot
        # serve is skipped, and the run says so if the host needs it.
        if "$pip" -m pip download --quiet --only-binary=:all: --dest "$wheelhouse.tmp" \
            --python-version "$v" --implementation cp --platform manylinux2014_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
            $(requirements) >"$wheelhouse.tmp/.log-$v" 2>&1; then
            echo "wheelhouse: python $v served"
            got=$((got + 1))
        else
            echo "wheelhouse: python $v NOT served ($(tail -1 "$wheelhouse.tmp/.log-$v"))"
        fi
    done
    [ "$got" -gt 0 ] || { echo "wheelhouse: no python version could be served" >&2; exit 1; }
    rm -rf "$wheelhouse"
    mv "$wheelhouse.tmp" "$wheelhouse"
    echo "wheelhouse: $(ls "$wheelhouse"/*.whl | wc -l) wheels, $(du -sh "$wheelhouse" | cut -f1) in $wheelhouse"
}

missing() {
    # The requirements whose module the host's python cannot import.
    for r in "${REQUIREMENTS[@]}"; do
        "$PYTHON" -c "import ${r%%=*}" >/dev/null 2>&1 || echo "${r#*=}"
    done
}

run() {
    cd "$repo"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
        echo "tests/gpu: $PYTHON is $("$PYTHON" -V 2>&1); gelastic needs 3.11+" >&2
        exit 2
    }
    if ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
        echo "tests/gpu: NVIDIA devices: $(ls /dev/nvidia[0-9]* | tr '\n' ' ')"
    else
        echo "tests/gpu: no NVIDIA GPU on this host (no /dev/nvidiaN): every GPU test skips"
    fi
    "$PYTHON" -c 'import torch; print(f"tests/gpu: host torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")' \
        2>/dev/null || echo "tests/gpu: the host's python has no torch: every GPU test skips"
    local deps="${GPU_DEPS_DIR:-${TMPDIR:-/tmp}/gelastic-gpu-deps-$(id -u)}"
    mapfile -t need < <(missing)
    if [ "${#need[@]}" -gt 0 ]; then
        [ -d "$wheelhouse" ] || { echo "tests/gpu: the host lacks ${need[*]} and there is no wheelhouse: run '$0 build' first" >&2; exit 2; }
        rm -rf "$deps"
        mkdir -m 0700 -p "$deps"
        echo "tests/gpu: installing from the wheelhouse into $deps: ${need[*]}"
        "$PYTHON" -m pip install --quiet --no-index --find-links "$wheelhouse" --target "$deps" \
            --no-warn-script-location "${need[@]}"
    fi
    export PYTHONPATH="$deps:$repo${PYTHONPATH:+:$PYTHONPATH}"
    export GELASTIC_GPU_TESTS=1
    timeout --kill-after=10 "$GPU_TEST_TIMEOUT" \
        "$PYTHON" -m pytest -q -rsx -p no:cacheprovider tests/gpu
}

case "${1:-all}" in
    build) build ;;
    run) run ;;
    all) [ -d "$wheelhouse" ] || build; run ;;
    *) echo "usage: $0 [build|run]" >&2; exit 2 ;;
esac
