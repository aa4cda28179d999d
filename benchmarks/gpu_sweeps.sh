#!/usr/bin/env bash
# Sweeps side by side on a lent GPU machine (run in a copy of the working tree there; what is
# under $OUT comes back), for reproductions that a CPU cannot finish:
#   bash benchmarks/gpu_sweeps.sh SECONDS 'SWEEP_FILE [--only TAG ...] [--lanes N] [--from=ARCHIVE]' ['SWEEP_FILE ...' ...]
# Each sweep runs with run.device=cuda and run.engine=vectorized, pinned to its own share of the
# CPUs (the sweep splits its share between its lanes, $SWEEP_LANES, default 2), and is stopped
# with SIGTERM after SECONDS (a spec's own --lanes N overrides $SWEEP_LANES for that sweep): finished runs are complete, an unfinished one keeps its last checkpoint. Each sweep's output folder comes back as $OUT/sweepN.tar.gz with every
# unfinished run's checkpoint under 8 MB (an unfinished small run resumes elsewhere with `fedhet sweep
# ... --out FOLDER --set run.device=cpu` on the unpacked folder; larger checkpoints, e.g. 20 clients'
# kept momentum, stay behind;
# finished runs need none; `fedhet sweep SWEEP_FILE --adopt sweepN.tar.gz` copies the completed ones' small
# files into the sweep's own folder, to commit). With PYTEST_SECONDS set, $PYTEST_FILES (default
# tests/engine/test_engine_vectorized.py) run meanwhile with their device side on CUDA
# (FEDHET_TEST_DEVICE=cuda), on 4 CPUs and 4 workers of their own.
# The device call's own timeout must cover SECONDS plus setup and the archive (12 s for SECONDS=520
# on an H200: 532 s), plus up to 30 s more if a run ignores SIGTERM; else nothing comes back. Exit status: the worst of the sweeps' and the tests' (124: stopped at SECONDS).
# Each sweep starts from the runs its own folder (the file's `out`) holds in the copy of the working
# tree: the runs committed there are left alone and only the missing ones run (below).
# Prepared here as for benchmarks/gpu_check.sh: .whl/ (pydantic and its needs) and
# .devdata/fashion_mnist/ (the four .gz files), both copied along with the working tree.
# A dry run on a machine without CUDA, before device time is spent: GPU_SWEEPS_DEVICE=cpu (runs on the
# CPU, run.engine as each config says).
set -u
usage='usage: gpu_sweeps.sh SECONDS "SWEEP_FILE [--only TAG ...] [--lanes N] [--from=ARCHIVE]" ["SWEEP_FILE ..." ...]'
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
deadline=$1
shift
device=${GPU_SWEEPS_DEVICE:-cuda}
case $device in
  cuda) device_sets=(--set run.device=cuda --set run.engine=vectorized) ;;
  cpu) device_sets=(--set run.device=cpu) ;;
  *) echo "gpu_sweeps.sh: GPU_SWEEPS_DEVICE must be cuda (the default) or cpu (a dry run), got '$device'" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/gpu_sweeps_out}
mkdir -p "$OUT"
# A folder of this call's own: a machine kept warm between calls still holds the last call's.
work=$(mktemp -d /tmp/gpu_sweeps.XXXXXX)
export PYTHONUNBUFFERED=1 FEDHET_DATA=$PWD/.devdata PYTHONPATH=$PWD/src
if [ "$device" = cuda ] && ls .whl/*.whl >/dev/null 2>&1; then   # the dry run uses what this python has
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD/src:/tmp/site || exit 1
fi
set -f   # from here on the sweep specs are split into words, never glob-expanded (.whl/*.whl above is)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda,
'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name(0))"
  nproc; git rev-parse HEAD 2>/dev/null; date -u; } > "$OUT/sweeps_machine.txt" 2>&1
cat "$OUT/sweeps_machine.txt"

# The CPUs this process may use (not necessarily 0..n-1), handed out in shares.
read -ra allowed <<< "$(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)))')"
cpu_list() { local IFS=,; echo "${allowed[*]:$1:$2}"; }   # cpu_list START COUNT
test_cpus=0
[ -n "${PYTEST_SECONDS:-}" ] && test_cpus=4
share=$(( (${#allowed[@]} - test_cpus) / $# ))
if [ "$share" -lt 1 ]; then
  echo "gpu_sweeps.sh: ${#allowed[@]} CPUs are too few for $# sweep(s) and $test_cpus test CPUs" >&2; exit 2
fi
status=0
pids=()
n=0
# Each sweep's folder of this call is made of --from=ARCHIVE (a sweepN.tar.gz an earlier call brought
# back, committed or copied along: its unfinished runs go on from their checkpoints), then the sweep's own
# folder copied over it, so a run committed as completed stays completed whatever the archive holds.
# Every folder is ready before any sweep starts, so a bad sweep file or archive stops the call with
# nothing running.
for spec in "$@"; do
  file=
  for word in $spec; do
    case $word in
      *.yaml|*.yml) file=$word ;;
    esac
  done
  [ -n "$file" ] || { echo "gpu_sweeps.sh: no sweep file (*.yaml) in '$spec'" >&2; exit 2; }
  own=$(python3 -c 'import sys; from fedhet.experiment.sweep import load_sweep; print(load_sweep(sys.argv[1]).out)' \
        "$file") || { echo "gpu_sweeps.sh: cannot read the sweep file '$file'" >&2; exit 2; }
  mkdir -p "$work/sweep$n"
  for word in $spec; do
    case $word in
      --from=*) tar -xzf "${word#--from=}" -C "$work/sweep$n" --strip-components=1 \
                  || { echo "gpu_sweeps.sh: cannot unpack ${word#--from=}" >&2; exit 2; } ;;
    esac
  done
  if [ -d "$own" ]; then
    cp -a "$own/." "$work/sweep$n/" || { echo "gpu_sweeps.sh: cannot copy $own" >&2; exit 2; }
    echo "sweep$n starts from $own: $(find "$own" -name summary.json | wc -l) run folders"
  fi
  n=$(( n + 1 ))
done
n=0
for spec in "$@"; do
  words=()
  for word in $spec; do
    case $word in
      --from=*) ;;
      *) words+=("$word") ;;
    esac
  done
  timeout -s TERM -k 30 "$deadline" taskset -c "$(cpu_list $(( n * share )) "$share")" python3 -m fedhet.cli sweep \
    --lanes "${SWEEP_LANES:-2}" "${words[@]}" --out "$work/sweep$n" "${device_sets[@]}" \
    > "$OUT/sweep$n.log" 2>&1 &
  pids+=($!)
  echo "sweep$n on CPUs $(cpu_list $(( n * share )) "$share"): $spec"
  n=$(( n + 1 ))
done
if [ -n "${PYTEST_SECONDS:-}" ]; then
  # shellcheck disable=SC2086  # PYTEST_FILES is a list of paths
  FEDHET_TEST_DEVICE=$device timeout -s TERM -k 20 "$PYTEST_SECONDS" taskset -c "$(cpu_list $(( n * share )) 4)" \
    python3 -m pytest -p no:cacheprovider -n 4 ${PYTEST_FILES:-tests/engine/test_engine_vectorized.py} \
    > "$OUT/pytest_cuda_sweeps.log" 2>&1
  rc=$?; [ $rc -gt $status ] && status=$rc
  echo "pytest_cuda: exit $rc"; tail -n 5 "$OUT/pytest_cuda_sweeps.log"
fi
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; rc=$?; [ $rc -gt $status ] && status=$rc
  echo "sweep$i: exit $rc"; tail -n 4 "$OUT/sweep$i.log"
  # Checkpoints travel only for runs not completed (a run stopped at the deadline writes its summary.json
  # too, with status "interrupted"), and only under 8 MB.
  (cd "$work" && find "sweep$i" -name checkpoint.pt \( -size +8M -o -execdir grep -qs '"status": "completed"' \
    summary.json \; \) -print) > "$work/large$i.txt"
  tar -czf "$OUT/sweep$i.tar.gz" -X "$work/large$i.txt" -C "$work" "sweep$i"
done
ls -la "$OUT"
exit "$status"
