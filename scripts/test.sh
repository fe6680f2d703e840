#!/usr/bin/env bash
# The project's test command (README and .ci/run call exactly this). Sets up the venv on first
# use, then runs the whole suite, slow end-to-end tests included. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not slow"` for a quick loop.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh
set +e
python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    # pytest's "no tests collected": a suite that ran nothing must not pass as green.
    echo "scripts/test.sh: pytest collected no tests; failing on purpose" >&2
    exit 1
fi
exit "$rc"
