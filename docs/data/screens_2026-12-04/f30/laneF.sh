#!/usr/bin/env bash
# Issue #48 item 5 (2026-12-04, session 26), from the detached worktree /work/wt_c at 3feacef (the defaults' training
# code): Flow-GRPO's default, 30 iterations, 5 seeds and the start run, one thread, evaluations every 10 iterations
# (the iteration-10 evaluations must equal f15's: same model, seeds and evaluation sample).
set -u
cd /work/wt_c
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos flowgrpo_baseline --seeds 1 2 3 4 5 --jobs 1 --threads 1 --iterations 30 \
  --eval-every 10 --out /work/runs_s26/f30
echo laneF done $(date)
