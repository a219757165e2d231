#!/usr/bin/env bash
# Issue #36 item 3e, lane B (2026-12-04, session 25), from the detached worktree /work/wt_e at c82cda8.
# DenseGRPO's default with GRPO-Guard's ratio normalisation, 15 iterations (against verdict/d15).
set -u
cd /work/wt_e
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos densegrpo --seeds 1 2 3 4 5 --jobs 1 --threads 1 --iterations 15 \
  --eval-every 5 --variants "guard=--ratio-norm guard" --out /work/runs_s25/d15g
echo laneB done $(date)
