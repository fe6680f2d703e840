#!/usr/bin/env bash
# The main job's demo (README): offline, about a minute on 2 CPU cores. Trains the quick preset on
# synthetic CIFAR-10, SIGKILLs it at random steps, resumes each time, and prints the audit and
# whether the final weights equal an uninterrupted run's. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh
exec python -m examples.kill_and_resume "$@"
