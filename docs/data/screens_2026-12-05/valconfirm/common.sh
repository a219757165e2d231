# Sourced by the lanes of session 29 (2026-12-05): issue #48 item 1, the GRPO defaults on the RL mix without the
# validation prompts (test prompts, the headline) and confirmed against their runner-ups on the validation prompts.
# From the detached worktree /work/wt_s28 at d848c22 (training code identical to main).
set -u
cd /work/wt_s28
export PATH=/work/venv/bin:$PATH OMP_WAIT_POLICY=PASSIVE
BC="python benchmarks/bench_compare.py --jobs 1 --threads 1 --eval-every 10"
# valeval ALGO FOLDER SEED...: the finished test-prompt run's final weights (checkpoint-N) evaluated on the
# validation prompts with the seeds bench_compare --split validation gives a final evaluation (14 per prompt),
# into /work/runs_s29/valeval/ALGO__default__SEED (a new run folder; the weights' digest is printed in its log)
valeval() {
  local algo=$1 dir=$2; shift 2
  for s in "$@"; do
    local src; src=$(ls -d "$dir/${algo}__default__$s"/checkpoint-* | sort -t- -k2 -n | tail -1)
    [ -e "/work/runs_s29/valeval/${algo}__default__$s/metrics.jsonl" ] && grep -q '"final": true' \
      "/work/runs_s29/valeval/${algo}__default__$s/metrics.jsonl" && continue
    rm -rf "/work/runs_s29/valeval/${algo}__default__$s"
    OMP_NUM_THREADS=1 python "$algo.py" --resume "$src" --resume-override \
      --eval-prompts common/toyworld/prompts_val.txt --final-eval-seeds-per-prompt 14 \
      --output-dir /work/runs_s29/valeval --run-name "${algo}__default__$s" \
      > "/work/runs_s29/valeval/${algo}__default__$s.log" 2>&1
  done
}
