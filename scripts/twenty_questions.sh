#!/usr/bin/env bash
# The 20 Questions study end to end, offline, on the embedded default model:
#   1. preference pairs on the training objects (20q:train) with both reward variants
#      (--metric-preset 20q-infogain and 20q-interactive), the table oracle answering;
#   2. dpo_train --lora --merge on each;
#   3. eval_multiturn of the base model and both trained models on the held-out objects
#      (--split test: no test object was ever generated from);
#   4. plot 20q (figures) and eval_multiturn --compare (the study's Table 1: success with 95%
#      intervals, turns, information gain per question, unparsed rate, McNemar's exact test).
#
# Usage: bash scripts/twenty_questions.sh [--quick] [--out DIR] [--policy SPEC]
#   --quick   a small run (12 objects, short games, few steps): ≤ 15 minutes on 2 cores.
#             Without it: every training object (about 2.5 hours on 2 cores).
#   --out     output root [default: outputs/20q or outputs/20q-quick].
#   --policy  the questioner that generates the pairs' candidates and is trained
#             [default: default]. A stronger local model (an HF directory or .gguf) is what
#             makes the numbers move; the base row of the table is this model.
# Every stage resumes: rerun the same command after an interruption.
# BIN_DIR=DIR uses the binaries in DIR instead of building target/release (a long run that
# must not pick up binaries rebuilt beside it); THREADS=N sets the compute threads.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

quick=0
out=""
policy="default"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out="$2"; shift ;;
    --policy) policy="$2"; shift ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [[ $quick == 1 ]]; then
  out="${out:-outputs/20q-quick}"
  gen=(--max-tasks 12 --candidates 3 --samples 1 --window 2 --max-questions 6)
  train=(--epochs 2 --lr 5e-5 --batch-size 4)
  eval=(--objects 12 --max-questions 10)
else
  out="${out:-outputs/20q}"
  # Every training object; games of 10 questions while generating (a 20-question game
  # costs twice as much and the window sees two messages ahead either way).
  gen=(--candidates 3 --samples 1 --window 2 --max-questions 10)
  # 8 pairs a step as 4 micro-batches of 2: the interactivity arm's pairs are long, and a
  # micro-batch of 8 holds 8 packed rows of full-vocabulary f32 logits (23 GB; OOM at 24).
  train=(--epochs 1 --lr 5e-5 --batch-size 2 --grad-accum 4)
  eval=(--objects all --max-questions 20)
fi
threads="${THREADS:-$(nproc)}"

bash scripts/fetch_default_model.sh
bin="${BIN_DIR:-target/release}"
if [[ -z "${BIN_DIR:-}" ]]; then
  cargo build --release --bin generate_conv --bin dpo_train --bin eval_multiturn --bin plot
fi
started=$(date +%s)
models=(--model "$policy")
for preset in infogain interactive; do
  run="$out/pairs-$preset"
  echo "== generate_conv ($preset) → $run"
  "$bin/generate_conv" --task-type twenty_questions --tasks 20q:train \
    --metric-preset "20q-$preset" --oracle table --policy "$policy" \
    "${gen[@]}" --threads "$threads" --output "$run"
  model="$out/dpo-$preset"
  if [[ ! -d "$model/merged" ]]; then
    echo "== dpo_train ($preset) → $model"
    resume=()
    [[ -d "$model" ]] && resume=(--resume) # an interrupted run continues from its checkpoint
    "$bin/dpo_train" --data "$run" --model "$policy" --lora --merge \
      "${train[@]}" --threads "$threads" --output "$model" "${resume[@]}"
  fi
  models+=(--model "$model/merged")
done

echo "== eval_multiturn (held-out objects) → $out/eval"
"$bin/eval_multiturn" --task twenty_questions --split test --oracle table --weights q8 \
  "${models[@]}" "${eval[@]}" --exclude-run "$out/pairs-infogain" \
  --exclude-run "$out/pairs-interactive" --threads "$threads" --output "$out/eval"

echo "== plot 20q → $out/figures"
"$bin/plot" 20q "$out/eval" --output "$out/figures"

echo "== Table 1 (base first)"
"$bin/eval_multiturn" --compare "$out/eval" --output "$out/compare"
echo "finished in $(( $(date +%s) - started )) s; table: $out/compare/compare.md"
