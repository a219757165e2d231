#!/usr/bin/env bash
# Issue #36 item 3e (2026-12-04, session 25), from the detached worktree /work/wt_e at c82cda8: DenseGRPO's default
# with --ratio-norm guard continued from its 15-iteration runs (d15g) with --resume to 30 iterations, the default's
# length (against c/, the default's 5 seeds at 30 iterations). Two lanes: `bash laneDense30.sh WAIT_FOR SEEDS...`
# waits until the line WAIT_FOR appears in its lane log, then resumes those seeds one after another.
set -u
wait_for=$1; shift
until grep -q "$wait_for" /work/runs_s25/laneA.log /work/runs_s25/laneB.log 2>/dev/null; do sleep 30; done
cd /work/wt_e
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
export PYTHONPATH=/work/wt_e OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1
mkdir -p /work/runs_s25/d30g
for s in "$@"; do
  d=/work/runs_s25/d30g/densegrpo__guard__$s
  cp -a /work/runs_s25/d15g/densegrpo__guard__$s $d
  python densegrpo.py --seed $s --num-iterations 30 --cpu-budget-s 0 --eval-every 5 --save-every 100000 \
    --eval-seeds-per-prompt 2 --final-eval-seeds-per-prompt 8 --ratio-norm guard --resume $d > $d/stdout_resume.log 2>&1
  echo "seed $s done $(date)"
done
echo "lane $wait_for seeds $* done $(date)"
