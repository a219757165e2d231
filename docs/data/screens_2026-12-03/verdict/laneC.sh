#!/usr/bin/env bash
# Issue #36 item 3c (2026-12-03, session 23), from the detached worktree /work/wt_v at 86c1741, at nice 19 so that it
# takes the cores only as lanes A and B free them: the paper's Fig. 6b ablation at DenseGRPO's default, cut at 15
# iterations like lane A's d15 (the calibrated arm): psi(t) = --noise-level at every step (no calibration).
set -u
cd /work/wt_v
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos densegrpo --seeds 1 2 3 4 5 --jobs 2 --threads 1 --iterations 15 \
  --eval-every 5 --variants "uniform=--calibration-iterations 0" --out /work/runs_s23/d15u
echo laneC done $(date)
