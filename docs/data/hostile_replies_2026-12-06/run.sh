#!/bin/bash
# Issue #68's hostile replies against the reward client of each checkout given (23dca5d and the final commit),
# each case in its own process, 20 s at most; each checkout needs tests/hostile_server.py (copy it into 23dca5d's):
#   bash docs/data/hostile_replies_2026-12-06/run.sh /path/to/23dca5d /path/to/final
CASE="$(cd "$(dirname "$0")" && pwd)/case.py"
for root in "$@"; do
  echo "== $root ($(git -C "$root" rev-parse --short HEAD))"
  for i in $(seq 0 17); do
    (cd "$root" && OMP_NUM_THREADS=1 timeout 20 python "$CASE" "$i" 2>/dev/null; rc=$?
     [ $rc = 124 ] && echo "case $i: STILL WAITING after 20 s (killed)"; [ $rc != 0 ] && [ $rc != 124 ] && echo "case $i: exit $rc")
  done
done
