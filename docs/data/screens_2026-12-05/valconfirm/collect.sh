#!/usr/bin/env bash
# Copies the logs of session 29's runs (/work/runs_s29, 2026-12-05) into this folder, as committed, and writes
# digests.tsv: each default run's final-weights digest from its training log beside the digest its validation
# evaluation loaded (valeval/*.log). Two lanes wrote the same grid into two folders (g2_new and g2_newB, fval and
# fvalB), each with its own start run; one start run per group is kept, and collect checks that the two agree.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
S=/work/runs_s29
keep() {  # keep SRC_RUN DST_FOLDER: the small files of one run folder
  mkdir -p "$2/$(basename "$1")"
  for f in args.json harness.json metrics.jsonl psi.json; do [ -e "$1/$f" ] && cp "$1/$f" "$2/$(basename "$1")/"; done
  return 0
}
final() { grep '"final": true' "$1/metrics.jsonl" | python3 -c "import sys,json; print(json.loads(sys.stdin.read())['eval/accuracy'])"; }
for pair in "g2_new g2_newB g2rpo__default" "fval fvalB flowgrpo_baseline__lr6e-4"; do
  set -- $pair
  a=$(final "$S/$1/$3__start"); b=$(final "$S/$2/$3__start")
  [ "$a" = "$b" ] || { echo "start runs differ: $1 $a, $2 $b" >&2; exit 1; }
  for d in "$S/$1"/$3__* "$S/$2"/$3__[0-9]*; do keep "$d" "$HERE/$1"; done
done
for g in g2val dval; do for d in "$S/$g"/*__*__*; do keep "$d" "$HERE/$g"; done; done
for d in "$S"/valeval/*__default__[0-9]; do keep "$d" "$HERE/valeval"; done
cp "$S"/lane*.sh "$S"/common.sh "$HERE/"
printf "algorithm\tseed\ttraining run's final weights\tweights evaluated on validation\n" > "$HERE/digests.tsv"
for v in "$S"/valeval/*__default__[0-9].log; do
  name=$(basename "$v" .log); algo=${name%%__*}; seed=${name##*__}
  case $algo in
    flowgrpo_baseline) src=/work/runs_s27/head ;;
    densegrpo) src=/work/runs_s28/dense_new ;;
    g2rpo) src=$S/g2_new; [ -d "$src/$name" ] || src=$S/g2_newB ;;
  esac
  printf "%s\t%s\t%s\t%s\n" "$algo" "$seed" "$(grep -o 'sha256 [0-9a-f]*' "$src/$name/stdout.log" | tail -1 | cut -d' ' -f2)" \
    "$(grep -o 'sha256 [0-9a-f]*' "$v" | tail -1 | cut -d' ' -f2)" >> "$HERE/digests.tsv"
done
