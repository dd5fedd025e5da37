#!/usr/bin/env bash
# The DPO training-step benchmark of BENCHMARKS.md: `bench train-step` (full fine-tuning and
# LoRA) interleaved, round after round, with the PyTorch + TRL baseline on the same step, so
# that both sides see the same machine state. Prints one JSON line per measurement.
#
#   bash scripts/bench_train_step.sh PYTHON [ROUNDS] [BENCH_BINARY...]
#
# PYTHON: an interpreter with torch, transformers, trl and peft (see bench_trl_step.py).
# BENCH_BINARY: `bench` builds to compare (default target/release/bench), e.g. one built
# from an older commit. Needs the default model and an HF export of it in outputs/bench-hf
# (made here on first use: a one-step dpo_train run whose only step has learning rate 0).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python="${1:?usage: bench_train_step.sh PYTHON [ROUNDS] [BENCH_BINARY...]}"
rounds="${2:-2}"
shift $(( $# >= 2 ? 2 : 1 ))
benches=("$@")
[ ${#benches[@]} -gt 0 ] || benches=(target/release/bench)
steps=8

if [ ! -f outputs/bench-hf/final/model.safetensors ]; then
  [ -f outputs/quickstart/pairs/train.parquet ] || bash scripts/quickstart.sh >&2
  target/release/dpo_train --data outputs/quickstart --max-steps 1 --warmup-ratio 0.5 \
    --output outputs/bench-hf --threads 2 >&2
fi

for round in $(seq 1 "$rounds"); do
  for lora in "" "--lora"; do
    for b in "${benches[@]}"; do
      "$b" train-step --threads 2 --steps "$steps" $lora 2>/dev/null | tail -n 1 |
        sed "s|^{|{\"round\":$round,\"binary\":\"$b\",|"
    done
    "$python" scripts/bench_trl_step.py outputs/bench-hf/final --threads 2 --steps "$steps" \
      --precompute-ref $lora 2>/dev/null | tail -n 1 | sed "s|^{|{\"round\":$round,|"
  done
done
