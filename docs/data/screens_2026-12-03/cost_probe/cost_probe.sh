#!/bin/bash
# CPU seconds per training iteration of Flow-GRPO's default and the DenseGRPO candidate, side by side, one thread each
cd "$(git rev-parse --show-toplevel)"  # a checkout at 1ef67c5 was used
out=${OUT:-runs/cost_probe}; mkdir -p $out
common="--num-iterations 4 --eval-every 100 --eval-prompts ${EVAL4:?a file with the first 4 test prompts} --eval-seeds-per-prompt 1 --save-every 100 --output-dir $out"
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python flowgrpo_baseline.py $common --run-name flow > $out/flow.log 2>&1 &
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python densegrpo.py $common --groups-per-iteration 32 --timestep-fraction 0.5 --completion-steps 2 --run-name dense > $out/dense.log 2>&1 &
wait
for r in flow dense; do python -c "
import json
rows=[json.loads(l) for l in open('$out/$r/metrics.jsonl')]
t=[r for r in rows if not r.get('final')]
per=[(b['time/cpu_s']-a['time/cpu_s']) for a,b in zip(t[1:],t[2:])]
print('$r', 'cpu/it (iterations 2-3..):', [round(p,1) for p in per], 'rollout_s', [round(r.get('time/rollout_s',0),1) for r in t[1:]], 'train_s', [round(r.get('time/train_s',0),1) for r in t[1:]], 'nfe', t[-1].get('nfe'))
"; done
