#!/usr/bin/env bash
# Set up fedhet on a fresh Debian/Ubuntu machine: Python venv, CPU torch, fedhet, Fashion-MNIST.
#   bash scripts/setup.sh          # what the main job needs (scripts/quickstart.sh): fedhet alone
#   bash scripts/setup.sh test     # and what the tests exercise: Flower (+ Ray), scikit-learn,
#                                  # TensorBoard/MLflow, pytest, ruff, mypy, import-linter
#   bash scripts/setup.sh flower   # and Flower with its simulation runtime (docs/deployment.md)
#   bash scripts/setup.sh mutation # pytest and mutmut (scripts/mutation.sh)
# Idempotent: re-running skips what is already there; fedhet is reinstalled only when
# pyproject.toml or the extras asked for changed (a stamp in .venv records them).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
case "${1:-}" in
  "") ;;
  test) extras="[test,dev,flower,flower-sim,features,tracking]" ;;
  flower) extras="[flower,flower-sim]" ;;
  mutation) extras="[test,mutation]" ;;
  *) echo "setup: unknown argument '$1' (nothing, 'test', 'flower' or 'mutation')" >&2; exit 2 ;;
esac
say() { echo "setup: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
  echo "setup: need root for: $*" >&2; exit 1; fi; }
# pip's own lines, shortened to one per package, so a long install shows progress.
pip_quietly() {
  set +e
  .venv/bin/pip install --disable-pip-version-check "$@" 2>&1 \
    | grep --line-buffered -E "^(Collecting|Successfully installed|ERROR|error)" | sed -u 's/^/setup:   /' >&2
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

need_apt=()
python3 -c "import venv, ensurepip" 2>/dev/null || need_apt+=(python3-venv python3-pip)
[ -d /usr/share/datasets/fashion-mnist ] || need_apt+=(dataset-fashion-mnist)
if [ ${#need_apt[@]} -gt 0 ]; then
  say "installing ${need_apt[*]} with apt-get"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  python3 -m venv .venv
fi
# torch first and pinned: a CPU wheel of this version is what fedhet is tested with; an unpinned
# torch would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  say "installing torch 2.13.0 (CPU build, about 200 MB)"
  pip_quietly "torch==2.13.0"
fi
# flwr 1.41.0 pinned: 1.42.0 pins a certifi newer than some package mirrors carry.
stamp=".venv/.fedhet-setup"
want="$(sha256sum pyproject.toml | cut -c1-16) ${extras:-core}"
have=$(cat "$stamp" 2>/dev/null || true)
if [ "$have" = "$want" ] || { [ -z "$extras" ] && [ -n "$have" ] && [ "${have#* }" != core ] \
                              && [ "${have% *}" = "${want% *}" ]; }; then
  say "fedhet already installed (${have#* }; pyproject.toml unchanged): skipping pip"
else
  say "installing fedhet${extras:+ with $extras} (editable)"
  if [ -n "$extras" ]; then pip_quietly -e ".$extras" "flwr==1.41.0"; else pip_quietly -e .; fi
  echo "$want" > "$stamp"
fi
say "done ($(.venv/bin/python -c 'import torch, fedhet; print("torch", torch.__version__, "fedhet", fedhet.__version__)'))"
