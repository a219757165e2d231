#!/usr/bin/env bash
source /work/runs_s29/common.sh
while kill -0 876 2>/dev/null; do sleep 20; done   # DenseGRPO new-mix seed 4 (session 28's lane, restarted)
$BC --algos g2rpo --seeds 1 3 --iterations 39 --out /work/runs_s29/g2_new; echo "g2_new 1 3 $(date -u)"
$BC --algos g2rpo --seeds 1 2 --iterations 39 --split validation --final-se 0.025 \
  --variants "b5x27=--branch-steps 0 1 2 3 4 --num-iterations 27" --out /work/runs_s29/g2val; echo "g2val $(date -u)"
$BC --algos g2rpo --seeds 5 --iterations 39 --out /work/runs_s29/g2_new; echo "g2_new 5 $(date -u)"
while pgrep -f "runs_s29/g2_newB" >/dev/null; do sleep 20; done
valeval g2rpo /work/runs_s29/g2_new 1 3 5; valeval g2rpo /work/runs_s29/g2_newB 2 4; echo "valeval g2 $(date -u)"
echo laneA done $(date -u)
