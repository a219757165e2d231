#!/usr/bin/env bash
# Issue #36 item 5, lane A (2026-12-03, session 23), from the detached worktree /work/wt_v at 86c1741.
# DenseGRPO's default: 15 iterations (3,840 trajectories: the equal-trajectory axis against G2RPO's 3,744), then each
# run copied and continued with --resume to 20 iterations (the CPU of Flow-GRPO's default: 30 / 1.49, the cost ratio
# measured side by side). Resume is bit-exact and the learning rate constant: the same as a 20-iteration run.
set -u
cd /work/wt_v
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos densegrpo --seeds 1 2 3 4 5 --jobs 1 --threads 1 --iterations 15 \
  --eval-every 5 --out /work/runs_s23/d15
export PYTHONPATH=/work/wt_v OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1
mkdir -p /work/runs_s23/d20
for s in 1 2 3 4 5; do
  d=/work/runs_s23/d20/densegrpo__default__$s
  cp -a /work/runs_s23/d15/densegrpo__default__$s $d
  python densegrpo.py --seed $s --num-iterations 20 --cpu-budget-s 0 --eval-every 5 --save-every 100000 \
    --eval-seeds-per-prompt 2 --final-eval-seeds-per-prompt 8 --resume $d > $d/stdout_resume.log 2>&1
done
echo laneA done $(date)
