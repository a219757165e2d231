#!/usr/bin/env bash
# seed 4 of laneDense30.sh, moved to the lane that frees first (lane D1 stopped after its seed 3, which finishes)
set -u
until grep -q "lane laneA done seeds 5 done" /work/runs_s25/laneD2.log 2>/dev/null; do sleep 10; done
cd /work/wt_e
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
export PYTHONPATH=/work/wt_e OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1
s=4; d=/work/runs_s25/d30g/densegrpo__guard__$s
cp -a /work/runs_s25/d15g/densegrpo__guard__$s $d
python densegrpo.py --seed $s --num-iterations 30 --cpu-budget-s 0 --eval-every 5 --save-every 100000 \
  --eval-seeds-per-prompt 2 --final-eval-seeds-per-prompt 8 --ratio-norm guard --resume $d > $d/stdout_resume.log 2>&1
echo "seed $s done $(date)"
