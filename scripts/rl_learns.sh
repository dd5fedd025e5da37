#!/usr/bin/env bash
# BENCHMARKS.md "rl_train learns": three seeds of GRPO on the default model with the
# multiturn-aware reward reduced to its length term (token_amount, weight −1: thousands of
# assistant tokens in the response and its future), one simulated-user future of one turn
# per response, LoRA r=16. Then the seeds' summary and the figure.
#
#   bash scripts/rl_learns.sh [steps]      # default 25 steps per seed
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-25}
for seed in 1 2 3; do
  out=outputs/rl_learn_s$seed
  rm -rf "$out"
  /usr/bin/time -f "seed $seed: %e s wall, peak RSS %M kB" \
    target/release/rl_train --tasks data/math.jsonl --opening task --samples 1 --window 2 \
      --max-tokens user=32 --metric token_amount=-1 --batch-prompts 2 --group-size 4 \
      --max-new-tokens 128 --max-steps "$steps" --lora-r 16 --lora-alpha 32 --lr 3e-4 \
      --seed "$seed" --output "$out"
done
python3 scripts/rl_seed_summary.py outputs/rl_learn_s1 outputs/rl_learn_s2 outputs/rl_learn_s3
target/release/plot rl outputs/rl_learn_s1 outputs/rl_learn_s2 outputs/rl_learn_s3 \
  --output outputs/figures/rl_learns --smooth 0.5
