#!/usr/bin/env bash
# The GPU checks, as one call on a lent GPU machine (run in a copy of the working tree there;
# what is under $OUT comes back). With no settings, one call measures the engines and one
# method of each family against the device's ceiling, evaluation's share, FedAvg's and FedCME's
# 100-round Table II runs and a full-size FedClassAvg round, in about 7 minutes on an H200 (the
# steps' own times there: tests 59 s, the two runs 53 + 68 s; the benchmark and FedClassAvg steps
# estimated, not yet timed together): give the call a timeout of 600 s; $DEADLINE below keeps
# the call inside it. Steps, each under its own time limit, so one that fails or overruns still
# leaves the others' results:
#   1. the machine: GPU, driver, torch, CUDA;
#   2. the CUDA tests ($PYTEST_SECONDS, default 120; $PYTEST_FILES): tests/engine/test_device.py
#      (every method on run.device cuda, reference and vectorized engines, against a CPU run, with no
#      forward pass of the CPU models), tests/engine/test_engine_vectorized.py with the vectorized
#      side on CUDA and a Flower node on CUDA (FEDHET_TEST_DEVICE=cuda), on 8 workers;
#   3. benchmarks/engine_gpu.py ($BENCH_SECONDS, default 200; $BENCH_ARGS, default "--settings
#      fedcme_a0.5 --rounds 1", which replaces the whole default: BENCH_ARGS=" " gives the script's own
#      defaults, BENCH_ARGS="--settings fedcme_a0.5 --rounds 1 --no-families" leaves the families out): samples/s of every engine mode against the same machine's CPU
#      engines and the device's own ceiling, one method of each family against the same ceiling,
#      evaluation's share of a round, and agreement with the CPU reference on real Fashion-MNIST;
#   3b. benchmarks/cross_device.py ($CROSS_SECONDS, default 0: skipped; $CROSS_ARGS, default "--rounds
#      1500 --modes vectorized:fp32 --limit <CROSS_SECONDS - 80>", the 80 s for start-up, data and the
#      ceiling, not yet timed on a GPU): the cross-device benchmark's run, each mode stopped after --limit
#      seconds and the whole run projected from its rounds, into $OUT/cross_device_<device>.*;
#   3c. benchmarks/repeatability.py ($REPEAT_SECONDS, default 0: skipped; about 150 s on an H200, estimated;
#      $REPEAT_ARGS, default "--rounds 10"): FedAvg at FedACD's Fashion-MNIST setting run twice without and
#      twice with run.deterministic, vectorized, each mode in a process of its own: whether a seed repeats
#      bit for bit and what the deterministic kernels cost, into $OUT/repeatability_<device>.*. With
#      FEDHET_TEST_DETERMINISTIC=1 set by the caller, step 2's tests run every method with run.deterministic
#      (and CUBLAS_WORKSPACE_CONFIG=:4096:8 from the start, as torch reads it once per process): an operation
#      without a deterministic CUDA kernel fails its method's test with torch's error naming it;
#   4. benchmarks/profile_device.py ($PROFILE_SECONDS per config, default 0: skipped): a
#      torch.profiler trace of one round of each of $PROFILE_CONFIGS (default: FedAvg at the FedCME
#      Table II setting), vectorized, into $OUT/profile_<config name>/;
#   5. benchmarks/vmap_conv.py ($CONV_SECONDS per case, default 0: skipped; $CONV_CASES, default
#      "cnn2:10:32", space-separated ARCH:CLIENTS:BATCH): one vmapped step with each way of computing
#      convolutions, into $OUT/vmap_conv_<arch>/;
#      benchmarks/device_runs.py: whole paper-setting runs on the device, timed, one step of
#      $RUNS_SECONDS (default 170) per entry of $RUN_SPECS='RUNS:ROUNDS[:LABEL];...', default
#      'fedcme_t2:100;fedclassavg_full:2:FedClassAvg vectorized' (FedAvg's and FedCME's 100-round
#      Table II runs; one full-size FedClassAvg round after the first), $RUN_LIMIT (default 100)
#      seconds per run, into device_runs_<i>.*; or, with $DEVICE_RUNS set, one step of that run set
#      ($DEVICE_ROUNDS default 20, $DEVICE_ONLY one run's label; $RUN_SPECS, if set too, wins);
#   6. optionally ($GPU_SWEEP='a.sweep.yaml [--only TAG] [--lanes N] [--from=ARCHIVE]; b.sweep.yaml',
#      $GPU_SWEEP_SECONDS, $GPU_SWEEP_LANES lanes per sweep): sweeps side by side on the device through
#      benchmarks/gpu_sweeps.sh (run.device=cuda, run.engine=vectorized, stopped at the limit, each
#      folder tarred into $OUT with its unfinished runs' checkpoints under 8 MB); with
#      $SWEEP_PYTEST_SECONDS the CUDA tests of step 2 run beside them instead (set PYTEST_SECONDS=0).
# PYTEST_SECONDS, BENCH_SECONDS or RUNS_SECONDS at 0 skips that step; RUN_SPECS= (empty) skips the runs.
# Prepared here: wheels of what the machine's python lacks in .whl/ (pydantic and its needs) and
# the four Fashion-MNIST .gz files in .devdata/fashion_mnist/; both are copied along with the working tree.
#
# A dry run on a machine without CUDA, before device time is spent: steps 2, 3 and 5 run as in the
# default call but on the CPU (--device cpu; the engine benchmark also --quick: E=1, a small ceiling)
# under short limits, so a broken step shows here; the sweeps of step 6 run on the CPU if given:
#   source .venv/bin/activate; GPU_CHECK_DEVICE=cpu OUT=/tmp/dry bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
CHECK_DEVICE=${GPU_CHECK_DEVICE:-cuda}
BENCH_DEVICE_ARGS=""
if [ "$CHECK_DEVICE" = cpu ]; then   # the dry run's limits: about 8 minutes in all (every family of step 3,
  # and each run of step 5 started: a step's limit covers its two runs' limits)
  DEADLINE=${DEADLINE:-560} PYTEST_SECONDS=${PYTEST_SECONDS:-45} BENCH_SECONDS=${BENCH_SECONDS:-340}
  RUNS_SECONDS=${RUNS_SECONDS:-75} RUN_LIMIT=${RUN_LIMIT:-30} PYTEST_WORKERS=${PYTEST_WORKERS:-2}
  BENCH_DEVICE_ARGS="--device cpu --quick"
elif [ "$CHECK_DEVICE" != cuda ]; then
  echo "gpu_check: GPU_CHECK_DEVICE must be cuda (the default) or cpu (a dry run), got '$CHECK_DEVICE'" >&2; exit 2
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
[ -d .devdata ] && export FEDHET_DATA=$PWD/.devdata   # else the usual places (fedhet.data.datasets)
if [ "$CHECK_DEVICE" = cuda ] && ls .whl/*.whl >/dev/null 2>&1; then   # the dry run uses what this python has
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD/src:/tmp/site || exit 1
fi

# The whole call's own deadline ($DEADLINE seconds, default 560): a step gets at most what is left
# of it less 40 s (the archive at the end), and none starts with under 30 s left, so the results
# come back within a device call of 600 s even when steps run to their limits.
DEADLINE=${DEADLINE:-560}
step() {  # step NAME SECONDS COMMAND...: log to $OUT/NAME.log, keep going on failure
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS left=$(( DEADLINE - 40 - SECONDS ))
  if [ "$left" -lt 30 ]; then echo "=== $name: skipped, ${left}s left of the call's deadline"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s)"
  timeout -s TERM -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  tail -n 25 "$OUT/$name.log"
}

if [ "$CHECK_DEVICE" = cpu ]; then
  { echo "dry run on the CPU (GPU_CHECK_DEVICE=cpu)"; lscpu | grep 'Model name'
    python3 -c "import torch, sys; print(sys.version); print('torch', torch.__version__)"; nproc; } > "$OUT/machine.txt" 2>&1
else { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda,
'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name(0), 'bf16', torch.cuda.is_bf16_supported())"
  nproc; } > "$OUT/machine.txt" 2>&1
fi
cat "$OUT/machine.txt"

[ "${PYTEST_SECONDS:-120}" = 0 ] || step pytest_cuda "${PYTEST_SECONDS:-120}" env FEDHET_TEST_DEVICE="$CHECK_DEVICE" \
  ${FEDHET_TEST_DETERMINISTIC:+CUBLAS_WORKSPACE_CONFIG=:4096:8} python3 -m pytest -p no:cacheprovider \
  -n "${PYTEST_WORKERS:-8}" ${PYTEST_FILES:-tests/engine/test_device.py tests/engine/test_engine_vectorized.py tests/flower/test_flower.py::test_a_node_on_the_device_trains_and_evaluates_there}
[ "${BENCH_SECONDS:-200}" = 0 ] || step engine_gpu "${BENCH_SECONDS:-200}" python3 benchmarks/engine_gpu.py --out "$OUT" ${BENCH_ARGS:---settings fedcme_a0.5 --rounds 1} $BENCH_DEVICE_ARGS
[ "${CROSS_SECONDS:-0}" = 0 ] || step cross_device "$CROSS_SECONDS" python3 benchmarks/cross_device.py --device "$CHECK_DEVICE" \
  --out "$OUT/cross_device_$CHECK_DEVICE" ${CROSS_ARGS:---rounds 1500 --modes vectorized:fp32 --limit $(( ${CROSS_SECONDS:-0} - 80 ))}
if [ "$CHECK_DEVICE" = cpu ]; then REPEAT_DEFAULT="--rounds 1 --set train.local_epochs=1 --set data.pool_fraction=0.05"
else REPEAT_DEFAULT="--rounds 10"; fi
[ "${REPEAT_SECONDS:-0}" = 0 ] || step repeatability "$REPEAT_SECONDS" python3 benchmarks/repeatability.py \
  --device "$CHECK_DEVICE" --out "$OUT/repeatability_$CHECK_DEVICE" ${REPEAT_ARGS:-$REPEAT_DEFAULT}
if [ "${PROFILE_SECONDS:-0}" != 0 ]; then
  for config in ${PROFILE_CONFIGS:-configs/papers/fedcme/fmnist_a0.5_k50_m10_fedavg.yaml}; do
    name=profile_$(basename "$config" .yaml)
    step "$name" "${PROFILE_SECONDS}" python3 benchmarks/profile_device.py --config "$config" --out "$OUT/$name"
  done
fi
[ "${CONV_SECONDS:-0}" = 0 ] || for case in ${CONV_CASES:-cnn2:10:32}; do
  IFS=: read -r arch clients batch <<< "$case"
  step "vmap_conv_$arch" "$CONV_SECONDS" python3 benchmarks/vmap_conv.py --out "$OUT/vmap_conv_$arch" --arch "$arch" \
    --clients "$clients" --batch "$batch"
done
# By default FedAvg's and FedCME's 100-round Table II runs, then one full-size FedClassAvg round
# after a first one (which captures the graphs).
[ -z "${DEVICE_RUNS:-}" ] && RUN_SPECS=${RUN_SPECS-"fedcme_t2:100;fedclassavg_full:2:FedClassAvg vectorized"}
if [ -n "${RUN_SPECS:-}" ] && [ "${RUNS_SECONDS:-170}" != 0 ]; then   # device_runs.py calls, each its own step and limit
  IFS=';' read -ra specs <<< "$RUN_SPECS"
  for i in "${!specs[@]}"; do
    IFS=: read -r runs rounds only <<< "${specs[$i]}"
    step "device_runs_$i" "${RUNS_SECONDS:-170}" python3 benchmarks/device_runs.py --out "$OUT" --tag "$i" --run $runs \
      --rounds "$rounds" --limit "${RUN_LIMIT:-100}" --device "$CHECK_DEVICE" ${only:+--only "$only"}
  done
elif [ -n "${DEVICE_RUNS:-}" ] && [ "${RUNS_SECONDS:-170}" != 0 ]; then
  step device_runs "${RUNS_SECONDS:-170}" python3 benchmarks/device_runs.py --out "$OUT" --run $DEVICE_RUNS \
    --rounds "${DEVICE_ROUNDS:-20}" --limit "${RUN_LIMIT:-100}" --device "$CHECK_DEVICE" ${DEVICE_ONLY:+--only "$DEVICE_ONLY"}
fi

if [ -n "${GPU_SWEEP:-}" ]; then   # $OUT/sweep0.tar.gz and sweep0.log, as benchmarks/gpu_sweeps.sh writes them
  IFS=';' read -ra sweeps <<< "$GPU_SWEEP"
  GPU_SWEEPS_DEVICE=$CHECK_DEVICE SWEEP_LANES="${GPU_SWEEP_LANES:-6}" PYTEST_SECONDS="${SWEEP_PYTEST_SECONDS:-}" \
    bash benchmarks/gpu_sweeps.sh "${GPU_SWEEP_SECONDS:-240}" "${sweeps[@]}" > "$OUT/gpu_sweeps.log" 2>&1
  echo "=== gpu_sweeps: exit $?"; tail -n 30 "$OUT/gpu_sweeps.log"
fi
# A GPU call here brings back at most 8 files of at most 16 MB each: everything goes into one archive
# beside machine.txt, except the sweeps' own archives (each up to a few MB of checkpoints).
tar czf /tmp/gpu_check_results.tar.gz -C "$OUT" --exclude machine.txt --exclude 'sweep*.tar.gz' . \
  && mv /tmp/gpu_check_results.tar.gz "$OUT/results.tar.gz"
find "$OUT" -mindepth 1 ! -name machine.txt ! -name results.tar.gz ! -name 'sweep*.tar.gz' -exec rm -rf {} + 2>/dev/null
ls -la "$OUT"
