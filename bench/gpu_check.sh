#!/usr/bin/env bash
# One command for a GPU machine (CUDA, compute capability 8.9+ for FP8), from the repository root:
#   bash bench/gpu_check.sh
# Installs lowbit with its plugins and Transformer Engine into .venv-gpu, runs the GPU tests
# (pytest -m gpu: real TE, real MS-AMP where installed), then prints the fp8-vs-bf16 table of
# bench/gpu_llama.py (step time and peak memory on a ~1B-parameter Llama-shaped model).
# TORCH_SPEC picks the torch build (default: the CUDA build pip chooses for this machine).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu
PY=.venv-gpu/bin/python
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "${TORCH_SPEC:-torch}"
"$PY" -m pip install -q -e ".[test]" -e plugins/fp8_ao -e plugins/fp8_msamp -e plugins/dist_deepspeed -e "plugins/fp8_te[te]"
"$PY" -m lowbit.cli.main env
echo "== GPU tests"
"$PY" -m pytest -m gpu -rs tests/plugins/te tests/plugins/msamp
echo "== fp8 against bf16, ~1B-parameter Llama"
"$PY" bench/gpu_llama.py
