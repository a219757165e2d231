#!/usr/bin/env bash
# Stability check of issue #36 item 4: the g32n2 setting's 5-seed runs (seeds 1-3, 30 iterations, 2026-12-03,
# docs/data/screens_2026-12-03/c) continued to 90 iterations with --resume (bit-exact resume: the same as one
# 90-iteration run; constant learning rate). The harness's environment and flags, one thread per run.
cd /work/wt_stab
export PYTHONPATH=/work/wt_stab OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE
for s in 1 2 3; do
  d=/work/runs_s22/stab90/densegrpo__g32n2__$s
  nohup /work/venv/bin/python densegrpo.py --seed $s --num-iterations 90 --cpu-budget-s 0 --eval-every 10 \
    --save-every 100000 --eval-seeds-per-prompt 2 --final-eval-seeds-per-prompt 8 --groups-per-iteration 32 \
    --timestep-fraction 0.5 --completion-steps 2 --resume $d > $d/stdout_resume.log 2>&1 &
done
wait
