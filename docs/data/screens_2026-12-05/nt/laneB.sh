#!/usr/bin/env bash
# Issue #48 item 4 (2026-12-05, session 28): DenseGRPO's paper-faithful main setting at the default batch: n = t
# completions (--completion-steps None), 9 of 10 steps trained (--timestep-fraction 0.99), 32 prompts x 8, 30
# iterations, our calibration rule (the default's). From the detached worktree /work/wt_s28 at d848c22, on the RL
# mix without the validation prompts, read on the TEST prompts (the cell of the verdict), one thread.
set -u
cd /work/wt_s28
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos densegrpo --seeds 1 2 --jobs 1 --threads 1 --iterations 30 \
  --eval-every 10 --out /work/runs_s28/nt --variants "nt=--completion-steps None --timestep-fraction 0.99"
echo laneB done $(date -u)
