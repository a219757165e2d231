#!/usr/bin/env bash
source /work/runs_s29/common.sh
while kill -0 884 2>/dev/null; do sleep 20; done   # DenseGRPO new-mix seed 5
$BC --algos densegrpo --seeds 1 2 --cpu-seconds 1200 --split validation --final-se 0.025 \
  --variants "g8nt=--groups-per-iteration 8 --completion-steps None" --out /work/runs_s29/dval; echo "dval $(date -u)"
valeval flowgrpo_baseline /work/runs_s27/head 1 2 3 4 5; valeval densegrpo /work/runs_s28/dense_new 1 2 3 4 5
echo "valeval flow dense $(date -u)"
$BC --algos g2rpo --seeds 2 4 --iterations 39 --out /work/runs_s29/g2_newB; echo "g2_newB $(date -u)"
$BC --algos flowgrpo_baseline --seeds 1 2 --iterations 30 --split validation --final-se 0.025 \
  --variants "lr6e-4=--learning-rate 6e-4" --out /work/runs_s29/fval; echo "fval $(date -u)"
echo laneB done $(date -u)
