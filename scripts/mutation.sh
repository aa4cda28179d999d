#!/usr/bin/env bash
# Mutation testing of the five seed methods (FedCME, FedFM, FedACD, FedClassAvg, FedReMa) and the
# shared pieces they train and aggregate with: mutmut changes one operator, constant or argument
# at a time (a "mutant") and runs the tests that reach that code; a mutant the tests let pass
# survives. Which files and tests: pyproject.toml's [tool.mutmut]. Result: the score table and
# every survivor in benchmarks/results/mutation.md and .json, by scripts/mutation_score.py;
# mutants that cannot change behaviour are set apart in scripts/mutation_equivalent.yaml.
#   bash scripts/mutation.sh             # about 2,000 mutants: hours on 2 cores; re-running
#                                        # re-checks only what changed (mutmut's cache in mutants/)
#   bash scripts/mutation.sh NAME ...    # re-check these mutants only (e.g. after adding a test)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh mutation
# mutmut keeps mutants/ between runs but never mutates a file it first copied unmutated: when the
# [tool.mutmut] section changes (other files or tests), start from a clean folder. (mutmut itself
# sets every recorded verdict back to "not checked" on such a change, even a test added to the
# selection: add tests to files already selected when a long run's results should be kept.)
config=$(sed -n '/^\[tool.mutmut\]/,/^\[/p' pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat mutants/.fedhet-config 2>/dev/null || true)" != "$config" ]; then
  rm -rf mutants
fi
# forkserver isolation (pyproject): each mutant's tests run in a process forked from a server that
# has imported torch and collected the tests once.
.venv/bin/mutmut run --max-children "${MUTATION_CHILDREN:-$(nproc)}" "$@"
echo "$config" > mutants/.fedhet-config
.venv/bin/python scripts/mutation_score.py --out benchmarks/results/mutation
