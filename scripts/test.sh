#!/usr/bin/env bash
# Set everything up, then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests - treating that as a failure" >&2
  exit 1
fi
exit "$rc"
