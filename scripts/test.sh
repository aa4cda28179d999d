#!/usr/bin/env bash
# Set everything up, then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Static checks first (seconds): lint, the layer contract (imports go downward only), types of
# the bottom layers. Any failure stops here with the tool's own message.
echo "test.sh: ruff" >&2
.venv/bin/ruff check src tests benchmarks
echo "test.sh: import contracts" >&2
.venv/bin/lint-imports --no-cache
echo "test.sh: mypy" >&2
.venv/bin/mypy
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests - treating that as a failure" >&2
  exit 1
fi
exit "$rc"
