#!/usr/bin/env bash
# Issue #47 item 2 (2026-12-04, session 27), from the detached worktree /work/wt_v at 9e31dd3 (the validation split):
# DiffusionNFT's toy-default screen on the VALIDATION prompts, at 20 iterations (1.25x Flow-GRPO's per-iteration cost,
# so 20 iterations fit under Flow-GRPO's 30): the default, a doubled learning rate, and half the batch for twice the
# iterations (the same images, so about the same CPU). Two seeds each, two runs side by side, one thread each.
set -u
cd /work/wt_v
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --split validation --algos diffusionnft --seeds 1 2 --jobs 2 --threads 1 \
  --iterations 20 --eval-every 10 --final-se 0.025 --out /work/runs_s27/nftval \
  --variants "default=" "lr6e-4=--learning-rate 6e-4" "g16x40=--groups-per-iteration 16 --num-iterations 40"
echo laneS done $(date)
