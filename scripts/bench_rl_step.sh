#!/usr/bin/env bash
# BENCHMARKS.md "rl_train step vs TRL GRPOTrainer": one GRPO step of the default model,
# 2 prompts × n=8, up to 64 new tokens, programmatic length reward, no simulated-user
# futures (TRL has none), lr 1e-6, KL 0.001, 1 PPO epoch, 2 threads. Interleaves ours and
# TRL round by round (this VM drifts between runs); 3 steps per run, the first is warm-up.
#
#   bash scripts/bench_rl_step.sh PYTHON [rounds] [micro_batch]
# PYTHON: an interpreter with torch, transformers, trl, datasets, gguf (scripts/bench_trl_grpo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:?python with trl}; rounds=${2:-2}; mb=${3:-16}
for r in $(seq "$rounds"); do
  out=$(mktemp -d)
  /usr/bin/time -f "ours round $r: peak RSS %M kB" target/release/rl_train \
    --tasks scripts/rl_bench_prompts.jsonl --opening task --samples 0 \
    --metric token_amount=-0.1 --batch-prompts 2 --group-size 8 --max-new-tokens 64 \
    --max-steps 3 --micro-batch "$mb" --threads 2 --output "$out/run" >/dev/null 2>"$out/err" \
    || { cat "$out/err"; exit 1; }
  tail -1 "$out/err"
  python3 - "$out/run/logs.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for d in rows:
    print(f"  ours step {d['step']}: {d['time/step']:.2f} s (rollout {d['time/rollout']:.2f}, "
          f"update {d['time/update']:.2f}, sync {d['time/sync']:.2f}), "
          f"{d['completion_length']:.1f} tokens/response")
PY
  "$py" scripts/bench_trl_grpo.py --steps 3 --threads 2 --json "$out/trl.json" >/dev/null 2>&1
  python3 - "$out/trl.json" "$r" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"TRL round {sys.argv[2]}: steps {[round(s, 2) for s in d['steps']]} s, "
      f"peak RSS {d['peak_rss_mb']:.0f} MB")
PY
  rm -rf "$out"
done
