# Sourced by scripts/demo.sh and scripts/test.sh: creates (once) and activates a virtual
# environment with every dependency of the project, keyed by a hash of pyproject.toml so that a
# second run, or a second clone, reuses it in seconds. The project itself is put on PYTHONPATH
# rather than installed, so two clones can share one venv.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
key="$(cat "$repo/pyproject.toml" "$repo/scripts/venv.sh" | sha256sum | cut -c1-16)"
venv="${CKPTSDK_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ckptsdk/venv-$key}"
if [ ! -f "$venv/.complete" ]; then
    echo "[setup] creating $venv (first run only; torch is large)" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" - "$repo/pyproject.toml" > "$venv/requirements.txt" <<'PY'
import sys, tomllib
proj = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = proj["optional-dependencies"]
reqs = list(proj["dependencies"])
for name in ("gcs", "cifar", "plot", "dev"):
    reqs += [r for r in extras[name] if not r.startswith("ckptsdk")]
print("\n".join(dict.fromkeys(reqs)))
PY
    # torch/torchvision first, at the versions this platform ships on disk where it has them.
    "$venv/bin/python" -m pip install -q "torch==2.14.1" "torchvision==0.29.1" \
        || "$venv/bin/python" -m pip install -q torch torchvision
    "$venv/bin/python" -m pip install -q -r "$venv/requirements.txt"
    touch "$venv/.complete"
fi
export PATH="$venv/bin:$PATH"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# gcsfs probes every bucket over gRPC unless told not to (minutes against an HTTP emulator).
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
cd "$repo"
