# Sourced by scripts/demo.sh, scripts/test.sh, and by you (`source scripts/venv.sh`): creates (once)
# and activates a virtual environment with every dependency of the project, keyed by a hash of
# pyproject.toml, this file and the interpreter ($PYTHON, else python3: two Pythons on one machine
# get two venvs), so that a second run, or a second clone, reuses it in seconds.
# The project itself is put on PYTHONPATH rather than installed, so two clones can share one
# venv; the venv's `ckptsdk` command runs the ckptsdk of whichever clone's PYTHONPATH is active.
# Sourcing changes only PATH, PYTHONPATH and GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT in your shell: the
# strict mode and the work happen in a subshell, and your directory stays where it was.

_ckptsdk_setup() (
    set -euo pipefail
    repo="$1"
    venv="$2"
    py="${PYTHON:-python3}"
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
for name in ("gcs", "cifar", "plot", "s3", "loader", "dev"):
    reqs += [r for r in extras[name] if not r.startswith("ckptsdk")]
print("\n".join(dict.fromkeys(reqs)))
PY
        # torch/torchvision first, at the versions this platform ships on disk where it has them.
        "$venv/bin/python" -m pip install -q "torch==2.14.1" "torchvision==0.29.1" \
            || "$venv/bin/python" -m pip install -q torch torchvision
        "$venv/bin/python" -m pip install -q -r "$venv/requirements.txt"
        touch "$venv/.complete"
    fi
    # The `ckptsdk` command (pyproject's [project.scripts]) without installing one clone into the
    # shared venv: it runs `python -m ckptsdk` from the PYTHONPATH of the shell that calls it.
    if [ ! -x "$venv/bin/ckptsdk" ]; then
        tmp="$venv/bin/.ckptsdk.$$"
        {
            printf '%s\n' '#!/bin/sh' \
                '# Written by scripts/venv.sh: the ckptsdk of the clone on PYTHONPATH (source its scripts/venv.sh).' \
                'exec "$(dirname "$0")/python" -m ckptsdk "$@"' > "$tmp" \
                && chmod +x "$tmp" && mv -f "$tmp" "$venv/bin/ckptsdk"
        } || echo "[setup] could not write $venv/bin/ckptsdk (a read-only venv?); use python -m ckptsdk" >&2
    fi
)

_ckptsdk_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_ckptsdk_key="$({ cat "$_ckptsdk_repo/pyproject.toml" "$_ckptsdk_repo/scripts/venv.sh"
                  "${PYTHON:-python3}" -c 'import sys; print(sys.executable, sys.version)' 2>/dev/null || true
                } | sha256sum | cut -c1-16)"
_ckptsdk_venv="${CKPTSDK_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ckptsdk/venv-$_ckptsdk_key}"
# Not `if _ckptsdk_setup ...`: bash ignores `set -e` inside a condition, even in a subshell.
_ckptsdk_setup "$_ckptsdk_repo" "$_ckptsdk_venv"
_ckptsdk_rc=$?
if [ "$_ckptsdk_rc" -eq 0 ]; then
    export PATH="$_ckptsdk_venv/bin:$PATH"
    export PYTHONPATH="$_ckptsdk_repo${PYTHONPATH:+:$PYTHONPATH}"
    # gcsfs probes every bucket over gRPC unless told not to (minutes against an HTTP emulator).
    export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
    unset -f _ckptsdk_setup
    unset _ckptsdk_repo _ckptsdk_key _ckptsdk_venv _ckptsdk_rc
else
    echo "[setup] scripts/venv.sh: setting up $_ckptsdk_venv failed (see above)" >&2
    unset -f _ckptsdk_setup
    unset _ckptsdk_repo _ckptsdk_key _ckptsdk_venv _ckptsdk_rc
    return 1 2>/dev/null || exit 1
fi
