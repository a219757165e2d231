#!/usr/bin/env bash
# Issue #48 item 1 (2026-12-05, session 29): DenseGRPO's default on the RL mix without the validation prompts, seed 5,
# started again from nothing (session 28's attempt stopped at iteration 9 / 1 without a checkpoint). From /work/wt_s28 at d848c22.
set -u
cd /work/wt_s28
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos densegrpo --seeds 5 --jobs 1 --threads 1 --iterations 30 \
  --eval-every 10 --out /work/runs_s28/dense_new
echo laneB5 done $(date -u)
