#!/usr/bin/env bash
# The device call (benchmarks/device_call.sh) rehearsed on CPU; .ci/run runs it after the tests. In a fresh virtual
# environment holding only the image's packages our code imports (benchmarks/device_image_requirements.txt; torch
# 2.13 CPU for its torch 2.11 CUDA), with the carried wheels fetched if .whl/ lacks them and installed as on the
# machine (no index, no dependencies, a folder on PYTHONPATH):
# 1. the call with --tiny: exit 0, and its out folder holds exactly the report's 3 files, every run PASS, the probe
#    answered;
# 2. the call again on one row, SIGTERM to it mid-row (as an outer timeout sends it): exit 143, the row STOPPED in the
#    report, and no process of the row's group left.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "== rehearsal of the device call in $WORK"
python3 -m venv "$WORK/venv"
V="$WORK/venv/bin/python"
quiet() { grep -v "^WARNING: Location 'file:///opt/" || true; } # this machine's pip names index folders it lacks
"$V" -m pip install -q -r benchmarks/device_image_requirements.txt 2>&1 | quiet
"$V" benchmarks/fetch_device_wheels.py 2>&1 | quiet
# the stand-in holds what the wheels need from the image, and none of the packages the image lacks (they would
# hide a missing wheel)
"$V" - <<'PY'
import importlib.metadata as md, sys
sys.path.insert(0, "benchmarks")
from fetch_device_wheels import IMAGE_HAS, IMAGE_LACKS
def has(name):
    try:
        return bool(md.distribution(name))
    except md.PackageNotFoundError:
        return False
lacking, extra = [n for n in IMAGE_HAS if not has(n)], [n for n in IMAGE_LACKS if has(n)]
if lacking or extra:
    sys.exit(f"rehearsal: the image stand-in lacks {lacking} and holds {extra}, which the image lacks")
PY

echo "== 1. the call, --tiny"
PYTHON="$V" SITE="$WORK/site" OUT="$WORK/out" JOB_TIMEOUT_S=1500 \
  bash benchmarks/device_call.sh --tiny --cache "$WORK/cache" --budget-s 1200
"$V" - "$WORK/out" <<'PY'
import json, os, sys
out = sys.argv[1]
files = sorted(os.listdir(out))
if files != ["gpu_first_run.json", "gpu_first_run.log", "gpu_first_run.md"]:
    sys.exit(f"rehearsal: the out folder holds {files}, not the report's 3 files")
results = json.load(open(os.path.join(out, "gpu_first_run.json")))
bad = [r["name"] for r in results if r["status"] not in ("PASS", "PROBE")]
if bad or not results:
    print("\n".join(open(os.path.join(out, "gpu_first_run.log")).read().splitlines()[-80:]))
    sys.exit(f"rehearsal: not passed: {bad or 'nothing ran'}")
print(open(os.path.join(out, "gpu_first_run.md")).read())
print("rehearsal: " + ", ".join(f"{f} {os.path.getsize(os.path.join(out, f))} bytes" for f in files))
PY

echo "== 2. SIGTERM mid-row"
PYTHON="$V" SITE="$WORK/site" OUT="$WORK/out2" \
  bash benchmarks/device_call.sh --tiny --cache "$WORK/cache" --only "flowgrpo SD3.5-M" >"$WORK/term.log" 2>&1 &
CALL=$! # the shell, then (exec) timeout; the job is its child, the row's torchrun the job's
RUN=""
for _ in $(seq 600); do
  for job in $(ps -o pid= --ppid "$CALL"); do
    for c in $(ps -o pid= --ppid "$job"); do
      if grep -q torch.distributed.run "/proc/$c/cmdline" 2>/dev/null && [ -n "$(ps -o pid= --ppid "$c")" ]; then
        RUN=$c
      fi
    done
  done
  [ -n "$RUN" ] && break
  sleep 0.5
done
if [ -z "$RUN" ]; then
  cat "$WORK/term.log"
  echo "rehearsal: the row's torchrun and its worker never showed"
  exit 1
fi
sleep 5 # mid-row: the worker loads the models and trains
# torchrun starts its worker in a session of its own: the row's processes are torchrun's group and the worker's
WORKERS=$(ps -o pid= --ppid "$RUN" | tr -s ' \n' ' ')
running() { # the pids given that still run (a zombie does not)
  for pid in "$@"; do
    state=$(awk '{sub(/.*\) /, ""); print $1}' "/proc/$pid/stat" 2>/dev/null || true)
    if [ -n "$state" ] && [ "$state" != Z ]; then echo -n "$pid "; fi
  done
}
ROW="$(ps -o pid= -g "$RUN" | tr -s ' \n' ' ') $WORKERS"
echo "the row's processes before SIGTERM: $ROW(torchrun $RUN, its worker $WORKERS)"
kill -TERM "$CALL"
set +e
wait "$CALL"
rc=$?
set -e
# shellcheck disable=SC2086 # one pid per word
left=$(running $ROW)
tail -n 3 "$WORK/term.log"
if [ "$rc" -ne 143 ] || [ -n "$left" ] || ! grep -q ": STOPPED: by SIGTERM" "$WORK/out2/gpu_first_run.md"; then
  echo "rehearsal: after SIGTERM the call exited $rc, processes of the row left: '${left}'"
  exit 1
fi
echo "rehearsal: SIGTERM mid-row: exit 143, the row STOPPED, none of its processes left"
