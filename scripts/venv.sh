# Sourced by scripts/demo.sh, scripts/test.sh, and by you (`source scripts/venv.sh`): creates (once)
# and activates a virtual environment with every dependency of the project, keyed by a hash of
# pyproject.toml, this file and the interpreter ($PYTHON, else python3: two Pythons on one machine
# get two venvs), so that a second run, or a second clone, reuses it in seconds.
# First run: says where it looks and what it installs, shows pip's progress, reuses a torch that
# $PYTHON can already import, and leaves nothing behind when killed (see _ckptsdk_setup).
# The project itself is put on PYTHONPATH rather than installed, so two clones can share one
# venv; the venv's `ckptsdk` command runs the ckptsdk of whichever clone's PYTHONPATH is active.
# Sourcing changes only PATH, PYTHONPATH and GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT in your shell: the
# strict mode and the work happen in a subshell, and your directory stays where it was.

_ckptsdk_setup() (
    set -euo pipefail
    repo="$1"
    venv="$2"
    py="$3"
    if [ ! -f "$venv/.complete" ] && command -v flock > /dev/null; then
        # Two set-ups of one venv at once (a test run and a shell sourcing this, two clones) would
        # install over each other and leave neither working: the second waits for the first, then
        # finds its venv complete. The lock is released when this subshell ends, however it ends.
        mkdir -p "$(dirname "$venv")"
        exec 9> "$venv.lock"
        if ! flock -n 9; then
            echo "[setup] another set-up of $venv is running: waiting for it to finish" >&2
            flock 9
        fi
    fi
    if [ ! -f "$venv/.complete" ]; then
        # A set-up that is killed or fails leaves no half venv and no pip running: each pip runs
        # in its own process group, stopped with it, and the folder goes (no .complete is made).
        child=""
        _stop() {
            trap - INT TERM HUP
            if [ -n "$child" ]; then
                kill -TERM -- "-$child" 2>/dev/null || kill -TERM "$child" 2>/dev/null || true
                wait "$child" 2>/dev/null || true
            fi
            rm -rf "$venv"
            echo "[setup] interrupted: stopped pip and removed the unfinished $venv" >&2
            exit 130
        }
        trap _stop INT TERM HUP
        trap 'rc=$?; if [ "$rc" -ne 0 ] && [ ! -f "$venv/.complete" ]; then rm -rf "$venv"; fi' EXIT
        # `setsid` puts pip in a group of its own (its build subprocesses too) so that _stop can
        # end all of it; `wait` keeps this shell able to run the trap meanwhile.
        run() {
            # 9>&-: pip does not hold the set-up lock (a stray build process must not block the next set-up).
            if command -v setsid > /dev/null; then setsid "$@" 9>&- & else "$@" 9>&- & fi
            child=$!
            wait "$child"
            local rc=$?
            child=""
            return "$rc"
        }
        pip() { run "$venv/bin/python" -m pip install --progress-bar on "$@"; }
        torch_imports() { "$venv/bin/python" -c 'import torch, torchvision' > /dev/null 2>&1; }
        echo "[setup] no complete venv at $venv: creating it (first run only; CKPTSDK_VENV=PATH reuses another)" >&2
        rm -rf "$venv"
        run "$py" -m venv "$venv"
        "$venv/bin/python" - "$repo/pyproject.toml" > "$venv/requirements.txt" <<'PY'
import sys, tomllib
proj = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = proj["optional-dependencies"]
reqs = list(proj["dependencies"])
for name in ("gcs", "cifar", "plot", "s3", "loader", "dev"):
    reqs += [r for r in extras[name] if not r.startswith("ckptsdk")]
print("\n".join(dict.fromkeys(reqs)))
PY
        # torch: a torch the interpreter can already import (Colab, a user's environment) is
        # reused, never replaced: the venv sees the folder holding it through a .pth file (the
        # --system-site-packages of that one folder, which also works when $py is itself a venv),
        # and pip then finds torch installed. Otherwise a CPU build on a machine without a GPU
        # (a fraction of the CUDA build's size), else the default (CUDA) build.
        if torch_at="$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)), torch.__version__)' 2>/dev/null)"; then
            site="${torch_at% *}"
            echo "[setup] reusing torch ${torch_at##* } from $site (importable by $py): not installing another" >&2
            "$venv/bin/python" -c 'import site, sys; print(site.getsitepackages()[0])' \
                | { read -r own; printf '%s\n' "$site" > "$own/zz-ckptsdk-reused-torch.pth"; }
        elif command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > /dev/null 2>&1; then
            echo "[setup] a GPU is present: installing torch and torchvision with CUDA (a 2-3 GB download, about 6 GB installed)" >&2
            pip "torch==2.14.1" "torchvision==0.29.1" || pip torch torchvision
        else
            cpu_index="${CKPTSDK_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
            echo "[setup] no GPU: installing the CPU build of torch and torchvision from $cpu_index (about 200 MB download, under 1 GB installed)" >&2
            # pip can "succeed" here with a pair that does not import together: with that index
            # out of reach, a machine's local wheels may give a CPU torch beside a PyPI torchvision
            # built for another ('operator torchvision::nms does not exist'). Only an import counts.
            if ! { pip --index-url "$cpu_index" --timeout 15 --retries 1 torch torchvision && torch_imports; }; then
                echo "[setup] no working CPU build from $cpu_index (pip's message above): installing the default build instead (CUDA, a 2-3 GB download, about 6 GB installed)" >&2
                pip "torch==2.14.1" "torchvision==0.29.1" || pip torch torchvision
            fi
        fi
        echo "[setup] installing the rest of the dependencies (pyproject.toml's extras)" >&2
        pip -r "$venv/requirements.txt"
        if ! torch_imports; then  # a venv that cannot run the job is not complete: say so, keep none
            echo "[setup] torch and torchvision are in $venv but do not import together:" >&2
            "$venv/bin/python" -c 'import torch, torchvision' 2>&1 | tail -n 1 >&2 || true
            echo "[setup] install a matching pair (https://pytorch.org/get-started/locally/) into the interpreter, or set CKPTSDK_TORCH_CPU_INDEX, then source this again" >&2
            exit 1
        fi
        touch "$venv/.complete"
        trap - INT TERM HUP EXIT
        echo "[setup] $venv is ready ($(du -sh "$venv" 2>/dev/null | cut -f1) on disk)" >&2
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
# The interpreter: $PYTHON as given, else python3; where python3 is one of these venvs already (a
# shell that sourced this before, or scripts/test.sh run from one), the one it was made from:
# sourcing again must reuse the venv, not key (and build) a second one on the first one's python.
_ckptsdk_py="${PYTHON:-}"
if [ -z "$_ckptsdk_py" ]; then
    _ckptsdk_py="$(python3 -c 'import os, sys
base = getattr(sys, "_base_executable", "")
print(base if base and os.path.isfile(os.path.join(sys.prefix, ".complete")) else "python3")' 2>/dev/null ||
        echo python3)"
fi
_ckptsdk_key="$({ cat "$_ckptsdk_repo/pyproject.toml" "$_ckptsdk_repo/scripts/venv.sh"
                  "$_ckptsdk_py" -c 'import os, sys; print(os.path.realpath(sys.executable), sys.version)' 2>/dev/null || true
                } | sha256sum | cut -c1-16)"
_ckptsdk_venv="${CKPTSDK_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ckptsdk/venv-$_ckptsdk_key}"
# Not `if _ckptsdk_setup ...`: bash ignores `set -e` inside a condition, even in a subshell.
_ckptsdk_setup "$_ckptsdk_repo" "$_ckptsdk_venv" "$_ckptsdk_py"
_ckptsdk_rc=$?
if [ "$_ckptsdk_rc" -eq 0 ]; then
    export PATH="$_ckptsdk_venv/bin:$PATH"
    export PYTHONPATH="$_ckptsdk_repo${PYTHONPATH:+:$PYTHONPATH}"
    # gcsfs probes every bucket over gRPC unless told not to (minutes against an HTTP emulator).
    export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
    unset -f _ckptsdk_setup
    unset _ckptsdk_repo _ckptsdk_key _ckptsdk_venv _ckptsdk_rc _ckptsdk_py
else
    echo "[setup] scripts/venv.sh: setting up $_ckptsdk_venv failed (see above)" >&2
    unset -f _ckptsdk_setup
    unset _ckptsdk_repo _ckptsdk_key _ckptsdk_venv _ckptsdk_rc _ckptsdk_py
    return 1 2>/dev/null || exit 1
fi
