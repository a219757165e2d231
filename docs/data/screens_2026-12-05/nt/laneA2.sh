#!/usr/bin/env bash
# Issue #48 item 4 (2026-12-05, session 28): the third seed of DenseGRPO's n = t cell (laneB.sh runs seeds 1-2), the
# same command, started when laneA.sh (NFT stability) has finished so that two runs share the two cores.
set -u
while kill -0 19949 2>/dev/null; do sleep 20; done
cd /work/wt_s28
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos densegrpo --seeds 3 --jobs 1 --threads 1 --iterations 30 \
  --eval-every 10 --out /work/runs_s28/nt --variants "nt=--completion-steps None --timestep-fraction 0.99"
echo laneA2 done $(date -u)
