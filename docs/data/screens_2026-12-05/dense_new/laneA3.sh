#!/usr/bin/env bash
# Issue #48 item 1 (2026-12-05, session 28): DenseGRPO's default re-run on the RL mix without the validation prompts
# (seed 2), started when the lane before it has finished; read on the test prompts like the headline. Its final
# weights can also be evaluated on the validation prompts to confirm the default there. From /work/wt_s28 at d848c22.
set -u
while kill -0 20417 2>/dev/null; do sleep 20; done
cd /work/wt_s28
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
python benchmarks/bench_compare.py --algos densegrpo --seeds 2 --jobs 1 --threads 1 --iterations 30 \
  --eval-every 10 --out /work/runs_s28/dense_new
echo laneA3 done $(date -u)
