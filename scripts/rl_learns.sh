#!/usr/bin/env bash
# BENCHMARKS.md "rl_train learns": three seeds of GRPO with LoRA on the default model, then the
# seeds' summary and the figure.
#
#   bash scripts/rl_learns.sh [steps] [length|20q]      # default: 25 steps, length
#
# length: the multiturn-aware reward reduced to its length term (token_amount, weight −1:
#         thousands of assistant tokens in the response and its future), math prompts, one
#         simulated-user future of one turn per response.
# 20q:    20 Questions against the table oracle with the exact `20q-infogain` reward (success 1,
#         information gain 1, token_amount −0.5): each sampled first question is answered by the
#         oracle and followed by one more question of the policy and its answer; the reward
#         counts the bits both questions gather.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-25}
mode=${2:-length}
case "$mode" in
  length)
    prefix=outputs/rl_learn
    flags=(--tasks data/math.jsonl --opening task --samples 1 --window 2 --max-tokens user=32
           --metric token_amount=-1 --batch-prompts 2 --group-size 4 --max-new-tokens 128) ;;
  20q)
    prefix=outputs/rl_learn_20q
    flags=(--tasks 20q:train --metric-preset 20q-infogain --samples 1 --window 3
           --batch-prompts 2 --group-size 8 --max-new-tokens 32) ;;
  *) echo "unknown mode $mode (length or 20q)" >&2; exit 2 ;;
esac
runs=()
for seed in 1 2 3; do
  out=${prefix}_s$seed
  rm -rf "$out"
  /usr/bin/time -f "seed $seed: %e s wall, peak RSS %M kB" \
    target/release/rl_train "${flags[@]}" --max-steps "$steps" --lora-r 16 --lora-alpha 32 \
      --lr 3e-4 --seed "$seed" --output "$out"
  runs+=("$out")
done
python3 scripts/rl_seed_summary.py "${runs[@]}"
target/release/plot rl "${runs[@]}" --output "outputs/figures/$(basename "$prefix")s" --smooth 0.5
