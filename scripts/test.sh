#!/usr/bin/env bash
# The project's test command (README and .ci/run call exactly this). Sets up the venv on first
# use, then runs the whole suite (tests/ and the doctests of ckptsdk/: pyproject's addopts), slow
# end-to-end tests included, on two pytest-xdist workers per core, at most 8
# (PYTEST_XDIST_AUTO_NUM_WORKERS=N for N; `-n 0` for none): the long tests mostly wait (lease
# ttls, killed children, the emulator), so two per core keep the cores busy (measured on 2 cores:
# 197 s with 4 workers, 274-293 s with 2). Tests marked xdist_group run on one worker together
# (--dist loadgroup).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for a quick loop.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh
export PYTEST_XDIST_AUTO_NUM_WORKERS="${PYTEST_XDIST_AUTO_NUM_WORKERS:-$(python -c 'import os; print(min(8, 2 * (os.cpu_count() or 1)))')}"
set +e
python -m pytest -q -p no:cacheprovider -n auto --dist loadgroup "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    # pytest's "no tests collected": a suite that ran nothing must not pass as green.
    echo "scripts/test.sh: pytest collected no tests; failing on purpose" >&2
    exit 1
fi
exit "$rc"
