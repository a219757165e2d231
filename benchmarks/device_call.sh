#!/usr/bin/env bash
# The first GPU job as one command on a GPU machine without network (docs/usage.md, "Your first GPU run"), run from a
# copy of the repository that carries .whl/ beside its tracked files (benchmarks/fetch_device_wheels.py fills it):
#
#     bash benchmarks/device_call.sh [more benchmarks/gpu_first_run.py flags]
#
# 1. installs the carried wheels (diffusers, tyro and what they need that the image lacks) into $SITE with no index
#    and no dependencies, so the image's torch and transformers stay as they are, and puts $SITE first on PYTHONPATH;
# 2. runs benchmarks/gpu_first_run.py (its --budget-s: 540 s) under `timeout` ($JOB_TIMEOUT_S, 560 s; SIGTERM, on
#    which the job ends its children and writes its report, then SIGKILL 15 s later), its 3 files into $OUT.
# $PYTHON (python3), $SITE (/tmp/flow_rl_site) and $OUT (/tmp/gpu_first_run) may be set: the CPU rehearsal
# (benchmarks/rehearse_device_call.sh) sets them.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/flow_rl_site}
OUT=${OUT:-/tmp/gpu_first_run}
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  echo "device_call: no wheels in .whl/: run python benchmarks/fetch_device_wheels.py where pip reaches PyPI, and carry .whl" >&2
  exit 1
fi
if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"; then
  echo "device_call: installing .whl/ into $SITE failed (above)" >&2
  exit 1
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
exec timeout -k 15 "${JOB_TIMEOUT_S:-560}" "$PY" benchmarks/gpu_first_run.py --out "$OUT" "$@"
