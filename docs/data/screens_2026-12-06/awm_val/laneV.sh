#!/usr/bin/env bash
# Issue #69 item 4 (2026-12-06): awm.py's toy-default screen on the VALIDATION prompts, from a snapshot of commit
# 665bcad (git archive into /tmp/awm69/tree), at an equal training budget of 300 CPU seconds per run: the default (the
# released recipe at the toy world's batch: 32 prompts x 8, learning rate 3e-4, 10 steps, six strata, beta 1e-3,
# ema_beta 1, tau 0.4 on [0.3, 0.9]), a learning rate of 1e-3, and no base KL (--beta 0: one forward less per row, so
# more iterations in the budget). Two seeds each, one run at a time, one thread.
set -u
cd /tmp/awm69/tree
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 WANDB_MODE=disabled
/work/main/.venv/bin/python benchmarks/bench_compare.py --split validation --algos awm --seeds 1 2 --jobs 1 \
  --threads 1 --cpu-seconds 300 --eval-every 10 --final-se 0.025 --out /tmp/awm69/awmval \
  --variants "default=" "lr1e-3=--learning-rate 1e-3" "beta0=--beta 0"
echo laneV done $(date)
