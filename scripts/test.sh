#!/usr/bin/env bash
# Set everything up, then run the static checks and the whole test suite.
#   bash scripts/test.sh                     # everything, as CI runs it (10-13 min on 2 quiet cores, up to 25 on slower ones: README)
#   bash scripts/test.sh -m "not deploy"     # the fast tier: no real Flower deployments
#   bash scripts/test.sh tests/engine -n 0   # any pytest arguments (-n 0: no worker processes)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
workers=${PYTEST_WORKERS:-$(( $(nproc) + 2 ))}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# pytest's exit 5 means no test ran: a failure here.
pytest_rc() { if [ "$1" = 5 ]; then echo "test.sh: pytest collected no tests ($2) - treating that as a failure" >&2; echo 1; else echo "$1"; fi; }

# Static checks first (seconds): lint and the layer contract (imports go downward only); any
# failure stops here with the tool's own message. mypy (types of the bottom layers, ~1 min) runs
# beside the tests; its verdict counts at the end.
echo "test.sh: ruff" >&2
.venv/bin/ruff check src tests benchmarks examples
echo "test.sh: import contracts" >&2
.venv/bin/lint-imports --no-cache
echo "test.sh: mypy (in the background)" >&2
# set +e: under -e the subshell would end at mypy's failure without writing its status
( set +e; .venv/bin/mypy > "$logs/mypy.log" 2>&1; echo $? > "$logs/mypy.rc" ) &

echo "test.sh: pytest on ${workers} worker(s)" >&2
set +e
# worksteal: an idle worker takes tests from a busy one, so one slow file does not end the run
# alone; the Flower deployments are collected first (tests/conftest.py) and mostly wait on Flower's
# polling, hence two workers more than there are CPUs (on 2 cores: 4 workers, 11.0 min; 3 workers
# took 15.7 min before the deployments were merged and slimmed, not re-measured since).
.venv/bin/python -m pytest -n "$workers" --dist worksteal --durations=20 "$@"
rc=$(pytest_rc $? "${*:-everything}")
wait
set -e
echo "test.sh: mypy:" >&2
cat "$logs/mypy.log"
[ "$(cat "$logs/mypy.rc")" = 0 ] || rc=1
exit "$rc"
