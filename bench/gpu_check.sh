#!/usr/bin/env bash
# Verify a GPU machine (CUDA, compute capability 8.9+ for FP8), offline. From the repository root:
#
#   bash bench/gpu_check.sh wheels [DIR]   # where pip reaches PyPI: lowbit, its plugins and what a GPU
#                                          # machine lacks (torchao, pluggy, pytest), as wheels in DIR
#                                          # (default dist/gpu-wheels; about 5 MiB, printed)
#   bash bench/gpu_check.sh tests [DIR]    # on the GPU machine, no network: installs those wheels beside
#                                          # the machine's own torch, transformers and accelerate and runs
#                                          # every `gpu` test file, each under its own limit (under 9 min)
#   bash bench/gpu_check.sh bench [DIR]    # the same install, then the Llama benchmark in pairs (under 9 min)
#   bash bench/gpu_check.sh run [DIR]      # tests, then bench (a machine without a time slot)
#   bash bench/gpu_check.sh                # wheels and run, on a GPU machine that has network
#
# A lent GPU slot gives 10 minutes a command: `tests` and `bench` are one command each, every
# result printed as it comes (bench/gpu_check.py). GPU_CHECK_BUDGET sets each part's seconds (540).
#
# The run step downloads and builds nothing: the wheels go into a folder on PYTHONPATH (no venv, no
# build isolation, no editable install); GPU_PYTHON picks the interpreter with the CUDA torch
# (default python3). The wheels are chosen for the GPU machine, not for the machine that downloads
# them (a laptop on macOS or ARM would otherwise carry torchao's kernel-less py3-none-any wheel):
# GPU_PLATFORM (default manylinux_2_28_x86_64; manylinux_2_28_aarch64 for a Grace machine) and
# GPU_PYTHON_VERSION (default 3.10: torchao's cp310-abi3 wheel serves every later CPython).
# Transformer Engine cannot be carried (its CUDA library alone is ~264 MiB): its
# tests run where it is installed already and otherwise skip, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:-all}
DIR=${2:-dist/gpu-wheels}
PLUGINS=(. plugins/fp8_ao plugins/fp8_te plugins/fp8_msamp plugins/dist_deepspeed)
# torchao as tested here; pluggy (lowbit's plugin system) and pytest with what it imports may be
# missing on a GPU image (exceptiongroup and tomli only for Python 3.10); peft for bench/lora.py (its
# dependencies, transformers and accelerate among them, are on the image). Installed without deps.
CARRIED=(torchao==0.18.0 "pluggy>=1.3" pytest iniconfig packaging pygments exceptiongroup tomli peft==0.21.2)
TARGET=(--platform "${GPU_PLATFORM:-manylinux_2_28_x86_64}" --python-version "${GPU_PYTHON_VERSION:-3.10}"
        --implementation cp --only-binary=:all:)

make_wheels() {
  rm -rf "$DIR" && mkdir -p "$DIR"
  python3 -m pip wheel -q --no-deps -w "$DIR" "${PLUGINS[@]}"
  python3 -m pip download -q --no-deps -d "$DIR" "${TARGET[@]}" "${CARRIED[@]}"
  echo "wheels in $DIR: $(ls "$DIR" | wc -l) files, $(du -sh "$DIR" | cut -f1) in all"
}

install_wheels() {
  local py=${GPU_PYTHON:-python3} site=.gpu-site
  ls "$DIR"/*.whl > /dev/null || { echo "no wheels in $DIR: run 'bash bench/gpu_check.sh wheels $DIR' where pip works" >&2; exit 2; }
  "$py" -c "import torch" || { echo "$py has no torch: set GPU_PYTHON to the interpreter with the machine's CUDA torch" >&2; exit 2; }
  rm -rf "$site"
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" "$DIR"/*.whl
  export PYTHONPATH="$PWD/$site${PYTHONPATH:+:$PYTHONPATH}"
  "$py" -m lowbit.cli.main env
}

check() {  # one part of bench/gpu_check.py: tests or bench
  "${GPU_PYTHON:-python3}" bench/gpu_check.py "$1" --budget "${GPU_CHECK_BUDGET:-540}"
}

case "$STEP" in
  wheels) make_wheels ;;
  tests|bench) install_wheels && check "$STEP" ;;
  run) install_wheels && { check tests || status=$?; check bench; exit "${status:-0}"; } ;;
  all) make_wheels && install_wheels && { check tests || status=$?; check bench; exit "${status:-0}"; } ;;
  *) echo "usage: bash bench/gpu_check.sh [wheels|tests|bench|run|all] [DIR]" >&2; exit 2 ;;
esac
