#!/usr/bin/env bash
# Issue #36 item 5, lane B (2026-12-03, session 23), from the detached worktree /work/wt_v at 86c1741.
# Flow-GRPO at G2RPO's default batch and iterations (12 prompts x 8, 39 iterations: G2RPO's paper protocol and its
# 3,744 trajectories), then Flow-GRPO's default cut at 15 iterations (3,840 trajectories).
set -u
cd /work/wt_v
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos flowgrpo_baseline --seeds 1 2 3 4 5 --jobs 1 --threads 1 --iterations 39 \
  --eval-every 13 --variants "g12=--groups-per-iteration 12 --rollout-batch-size 48" --out /work/runs_s23/f12
python benchmarks/bench_compare.py --algos flowgrpo_baseline --seeds 1 2 3 4 5 --jobs 1 --threads 1 --iterations 15 \
  --eval-every 5 --out /work/runs_s23/f15
echo laneB done $(date)
