#!/usr/bin/env bash
# Issues #47 items 2-3 (2026-12-05, session 27), from the detached worktree /work/wt_h: DiffusionNFT's toy default (chosen
# on the validation prompts, nftval/), 5 seeds and the start run, one thread, evaluations every 5 iterations (for the
# CPU at which it reaches Flow-GRPO's final), read on the TEST prompts; beside laneH1.sh (Flow-GRPO).
set -u
cd /work/wt_h
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos diffusionnft --seeds 1 2 3 4 5 --jobs 1 --threads 1 --iterations 20 \
  --eval-every 5 --out /work/runs_s27/head
echo laneH2 done $(date)
