#!/usr/bin/env bash
# Issues #47 items 2-3 and #48 item 1 (2026-12-05, session 27), from the detached worktree /work/wt_h at the commit that
# set DiffusionNFT's toy default from the validation screen: Flow-GRPO's default on the RL mix without the validation
# prompts, 30 iterations, 5 seeds and the start run, one thread, read on the TEST prompts; beside laneH2.sh (NFT).
set -u
cd /work/wt_h
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos flowgrpo_baseline --seeds 1 2 3 4 5 --jobs 1 --threads 1 --iterations 30 \
  --eval-every 10 --out /work/runs_s27/head
echo laneH1 done $(date)
