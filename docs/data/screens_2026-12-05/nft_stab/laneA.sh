#!/usr/bin/env bash
# Issue #47 item 2 (2026-12-05, session 28): DiffusionNFT's toy default at 3x its iterations. Seeds 1-3 of the 5-seed
# headline (runs_s27/head, trained from /work/wt_h at 6016769; training code identical to d848c22), copied and resumed
# from their checkpoint-20 to 60 iterations (resume is bit-exact, tests/test_recovery.py), one thread each, evaluated
# on the TEST prompts as the headline (every 5 iterations, 2 seeds/prompt; the final at 8 seeds/prompt).
set -u
cd /work/wt_h
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for s in 1 2 3; do
  echo "seed $s start $(date -u)"
  python diffusionnft.py --resume /work/runs_s28/stab/diffusionnft__default__$s --num-iterations 60 \
    > /work/runs_s28/stab/seed$s.log 2>&1
  echo "seed $s rc $? end $(date -u)"
done
echo laneA done $(date -u)
