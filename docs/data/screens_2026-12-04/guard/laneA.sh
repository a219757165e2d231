#!/usr/bin/env bash
# Issue #36 item 3e, lane A (2026-12-04, session 25), from the detached worktree /work/wt_e at c82cda8.
# Flow-GRPO's default with GRPO-Guard's ratio normalisation, 15 iterations (against verdict/f15), then each run copied
# and continued with --resume to 30 iterations (Flow-GRPO's default length, against its 2026-12-01 finals).
set -u
cd /work/wt_e
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos flowgrpo_baseline --seeds 1 2 3 4 5 --jobs 1 --threads 1 --iterations 15 \
  --eval-every 5 --variants "guard=--ratio-norm guard" --out /work/runs_s25/f15g
echo laneA f15g done $(date)
export PYTHONPATH=/work/wt_e OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1
mkdir -p /work/runs_s25/f30g
for s in 1 2 3 4 5; do
  d=/work/runs_s25/f30g/flowgrpo_baseline__guard__$s
  cp -a /work/runs_s25/f15g/flowgrpo_baseline__guard__$s $d
  python flowgrpo_baseline.py --seed $s --num-iterations 30 --cpu-budget-s 0 --eval-every 5 --save-every 100000 \
    --eval-seeds-per-prompt 2 --final-eval-seeds-per-prompt 8 --ratio-norm guard --resume $d > $d/stdout_resume.log 2>&1
done
echo laneA done $(date)
