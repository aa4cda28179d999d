#!/usr/bin/env bash
# Set up fedhet on a fresh Debian/Ubuntu machine: Python venv, CPU torch, fedhet, Fashion-MNIST.
# Idempotent: re-running skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
  echo "setup: need root for: $*" >&2; exit 1; fi; }

need_apt=()
python3 -c "import venv, ensurepip" 2>/dev/null || need_apt+=(python3-venv python3-pip)
[ -d /usr/share/datasets/fashion-mnist ] || need_apt+=(dataset-fashion-mnist)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} with apt-get" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch first and pinned: a CPU wheel of this version is what fedhet is tested with; an unpinned
# torch would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
# flwr 1.41.0 pinned: 1.42.0 pins a certifi newer than some package mirrors carry.
.venv/bin/pip install -q -e ".[test,dev,flower,flower-sim,features,tracking]" "flwr==1.41.0"
echo "setup: done ($(.venv/bin/python -c 'import torch, fedhet; print("torch", torch.__version__, "fedhet", fedhet.__version__)'))" >&2
