#!/usr/bin/env bash
# Breaks the vectorized engine on purpose, one way at a time, and runs the equivalence tests that
# must catch each break (tests/engine/test_engine_vectorized.py, module docstring). Every line of
# output must say "caught"; the engine's files are restored after each break, and on exit.
#   bash scripts/engine_breaks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
D=src/fedhet/engine/vectorized
BACKUP=$(mktemp -d)
cp -r "$D/." "$BACKUP"
trap 'cp -r "$BACKUP/." "$D"; rm -rf "$BACKUP"' EXIT
status=0
brk() {  # module of the engine, name, text to replace (exactly once), replacement, pytest -k expression[, test file]
  local F="$D/$1.py"
  shift
  local tests="${5:-tests/engine/test_engine_vectorized.py}"
  .venv/bin/python - "$2" "$3" "$F" <<'PY' || { echo "engine_breaks: '$1' no longer applies: update this script" >&2; exit 2; }
import sys
old, new, path = sys.argv[1:]
src = open(path).read()
if src.count(old) != 1:
    sys.exit(1)
open(path, "w").write(src.replace(old, new))
PY
  failed=$(.venv/bin/python -m pytest -q -p no:cacheprovider "$tests" -k "$4" 2>&1 \
           | grep -c '^FAILED')
  cp -r "$BACKUP/." "$D"
  if [ "$failed" -gt 0 ]; then echo "caught  $1: $failed test(s) failed [-k '$4']"
  else echo "MISSED  $1: every test passed [-k '$4']"; status=1; fi
}
brk grouping "first client's term constants for every client" \
    "g.batched_consts.append(_stack(values, device))" "g.batched_consts.append(_stack([values[0]] * len(values), device))" \
    "fedrs and nobn or fedlc and nobn"
brk grouping "frozen parameters trained" \
    "leaves = trained_names(model, first.weights, first.trainable)" "leaves = trained_names(model, first.weights)" \
    "fedbabu and nobn or frozen"
brk grouping "momentum not carried across calls" \
    "carried = first.optimizer_state is not None and n in first.optimizer_state" "carried = False" \
    "fedacd or carried or fedrema_table"
brk transport "last partial batch dropped" \
    "for positions in epoch_batches(n, s.batch_size, s.drop_last, gen):" \
    "for positions in epoch_batches(n, s.batch_size, True, gen):" \
    "fedavg and nobn or fedprox and nobn"
brk step "a bucket's weights not written back" \
    "                g.weights[n].index_copy_(0, idx, w[n].detach())" "                pass" \
    "unequal and nobn and (fedavg or moon or scaffold)"
brk kernels "a wide step updates the clients outside it" \
    "        p.add_(d if active is None else only(active, d), alpha=-opt.lr)" "        p.add_(d, alpha=-opt.lr)" \
    "wide_steps_equal and fedavg"
brk step "a wide step's BatchNorm statistics not restored" \
    "    kept = {n: g.weights[n].clone() for n in g.buffers} if active is not None else {}" "    kept = {}" \
    "wide_steps_equal and fedavg"
brk transport "augmentation drawn from another stream" \
    "draws = aug.draw(len(positions), gen) if aug is not None else {}" \
    "draws = aug.draw(len(positions), torch.Generator().manual_seed(0)) if aug is not None else {}" \
    "mixup or supcon"
brk transport "dropout masks drawn from another stream" \
    "draws.update(draw_masks(g.model, sample_shape, rows, gen))" \
    "draws.update(draw_masks(g.model, sample_shape, rows, torch.Generator().manual_seed(0)))" \
    "dropout" tests/training/test_dropout.py
exit $status
