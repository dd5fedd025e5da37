#!/usr/bin/env bash
# Training on one NVIDIA GPU, checked and measured in one go (about 5 minutes on an H200):
#   1. correctness: a tiny random llama trained one DPO step (full and LoRA) and one GRPO
#      update on the CPU and on the GPU in f32 from the same weights; loss and gradient norm
#      must agree to 1e-3 (relative);
#   2. the bench table: `bench train-step --device cuda --dtype bf16 --random-init` on the
#      shapes users train (0.5B and 1B full DPO and GRPO, 7B and 8B LoRA DPO), each run
#      after its memory estimate says it fits: step time, tokens/s, peak device memory,
#      model-FLOPs utilisation against the card's dense bf16 peak.
# Writes OUT/gpu_check.json (every run's JSON line, the checks, the card), OUT/gpu_check.md
# (the table as BENCHMARKS.md shows it) and OUT/runs.jsonl (each run's line as it ends); the
# runs' logs go to LOG_DIR (default OUT/logs).
#
# Usage: bash scripts/gpu_check.sh OUT [BENCH]
#   BENCH  a `bench` binary built with `--features cuda` for this GPU (may be gzipped);
#          default: build one here with `scripts/check_cuda_build.sh --build` (needs cargo;
#          set CUDA_RELEASE to the driver's CUDA release and CUDA_COMPUTE_CAP to the card's).
# Needs nvidia-smi and python3 (its site-packages' NVIDIA wheels hold cuBLAS, cuRAND and
# NVRTC when the loader's path has none). Exit status: the number of failed checks.
# RUN_TIMEOUT (seconds a run, default 100) and SHAPES_ONLY (a space-separated subset of the
# table's row names) adjust it.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=$(realpath -m "${1:?usage: gpu_check.sh OUT [BENCH]}")
logs=$(realpath -m "${LOG_DIR:-$out/logs}")
mkdir -p "$out" "$logs"
bench=${2:-}
per_run=${RUN_TIMEOUT:-100}
started=$(date +%s)

if [[ -z $bench ]]; then
  cd "$here/.." || exit 1
  bash scripts/check_cuda_build.sh --build || exit 1
  bench=target/cuda-check/release/bench
fi
if [[ $bench == *.gz ]]; then
  gunzip -c "$bench" > /tmp/collabllm-bench && chmod +x /tmp/collabllm-bench
  bench=/tmp/collabllm-bench
fi

libs=$(bash "$here/cuda_lib_path.sh")
export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
runs="$out/runs.jsonl"
: > "$runs"

# `one NAME ARGS...`: one bench run; its JSON line (or the error) appended to runs.jsonl.
one() {
  local name=$1
  shift
  local log="$logs/$name.log" t0=$SECONDS
  timeout "$per_run" "$bench" train-step --random-init "$@" > "$log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s"
  grep -E "^(estimate|time|MFU|peak memory|loss)" "$log" | sed 's/^/   /'
  local line
  line=$(grep '^{"' "$log" | tail -n 1)
  if [[ $rc == 0 && -n $line ]]; then
    echo "{\"name\":\"$name\",\"result\":$line}" >> "$runs"
  else
    local why
    why=$(tail -n 3 "$log" | tr '\n"\\' '   ' | cut -c1-300)
    echo "{\"name\":\"$name\",\"exit\":$rc,\"error\":\"$why\"}" >> "$runs"
  fi
}

# 1. CPU against GPU, f32, same weights.
tiny=(--shape tiny --dtype f32 --steps 1 --prompt-tokens 48 --completion-tokens 32)
for mode in "dpo-full:--algo dpo --batch 2" "dpo-lora:--algo dpo --batch 2 --lora --lora-r 8" \
  "grpo-full:--algo grpo --batch 8 --group-size 4"; do
  name=${mode%%:*}
  read -r -a flags <<< "${mode#*:}"
  one "check-$name-cpu" "${tiny[@]}" "${flags[@]}" --device cpu --threads "$(nproc)"
  one "check-$name-cuda" "${tiny[@]}" "${flags[@]}" --device cuda
done

# 2. The table: real shapes, bf16. DPO rows are packed pairs (prompt, chosen, rejected);
# GRPO rows a prompt and its group of 8 responses.
dpo=(--algo dpo --prompt-tokens 512 --completion-tokens 256)
grpo=(--algo grpo --group-size 8 --prompt-tokens 512 --completion-tokens 256)
table=(
  "llama-3.2-1b-dpo-full:--shape llama-3.2-1b ${dpo[*]} --batch 8"
  "qwen2.5-0.5b-dpo-full:--shape qwen2.5-0.5b ${dpo[*]} --batch 8"
  "llama-3.1-8b-dpo-lora:--shape llama-3.1-8b ${dpo[*]} --batch 4 --lora --lora-r 16 --gradient-checkpointing"
  "llama-3.2-1b-grpo-full:--shape llama-3.2-1b ${grpo[*]} --batch 16"
  "qwen2.5-0.5b-grpo-full:--shape qwen2.5-0.5b ${grpo[*]} --batch 16"
  "qwen2.5-7b-dpo-lora:--shape qwen2.5-7b ${dpo[*]} --batch 4 --lora --lora-r 16 --gradient-checkpointing"
  "llama-3.2-1b-dpo-full-ckpt:--shape llama-3.2-1b ${dpo[*]} --batch 8 --gradient-checkpointing"
  "llama-3.1-8b-dpo-lora-nockpt:--shape llama-3.1-8b ${dpo[*]} --batch 4 --lora --lora-r 16"
)
for row in "${table[@]}"; do
  name=${row%%:*}
  if [[ -n ${SHAPES_ONLY:-} && " $SHAPES_ONLY " != *" $name "* ]]; then
    continue
  fi
  read -r -a flags <<< "${row#*:}"
  one "$name" "${flags[@]}" --device cuda --dtype bf16 --steps 3
done

python3 - "$out" "$(cat "$out/gpu.txt")" "$(( $(date +%s) - started ))" <<'EOF'
import json, sys
out, gpu, secs = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = {}
for line in open(f"{out}/runs.jsonl"):
    r = json.loads(line)
    runs[r["name"]] = r
fails, checks = 0, []
for mode in ("dpo-full", "dpo-lora", "grpo-full"):
    a, b = runs.get(f"check-{mode}-cpu", {}), runs.get(f"check-{mode}-cuda", {})
    if "result" not in a or "result" not in b:
        checks.append({"check": mode, "pass": False, "detail": a.get("error") or b.get("error")})
        fails += 1
        continue
    worst = 0.0
    for k in ("loss", "grad_norm"):
        x, y = a["result"][k], b["result"][k]
        worst = max(worst, abs(x - y) / max(abs(x), 1e-3))
    ok = worst <= 1e-3
    fails += not ok
    checks.append({"check": mode, "pass": ok, "worst_relative_difference": worst,
                   "cpu": [a["result"]["loss"], a["result"]["grad_norm"]],
                   "cuda": [b["result"]["loss"], b["result"]["grad_norm"]]})
rows = [r for n, r in runs.items() if not n.startswith("check-")]
json.dump({"gpu": gpu, "seconds": secs, "checks": checks, "runs": rows},
          open(f"{out}/gpu_check.json", "w"), indent=1)
gib = lambda b: b / 2**30
lines = [f"GPU: {gpu}", "",
         "| run | mode | tokens/step | step (s) | tokens/s | TFLOP/s | MFU | peak memory (GiB) | estimate (GiB) |",
         "|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    if "result" not in r:
        lines.append(f"| {r['name']} | failed (exit {r.get('exit')}): {r.get('error', '')[:120]} | | | | | | | |")
        continue
    x = r["result"]
    mfu = f"{100 * x['mfu']:.1f} %" if x.get("mfu") is not None else "–"
    lines.append(f"| {r['name']} | {x['mode']}, {x['dtype']} | {x['tokens']} | {x['step_s']:.3f} | "
                 f"{x['tokens_per_s']:.0f} | {x['tflops']:.1f} | {mfu} | {gib(x['peak_bytes']):.1f} | "
                 f"{gib(x['estimate_bytes']):.1f} |")
lines.append("")
for c in checks:
    lines.append(f"- {'PASS' if c['pass'] else 'FAIL'} CPU vs CUDA {c['check']}: "
                 + (f"worst relative difference {c['worst_relative_difference']:.1e}"
                    if "worst_relative_difference" in c else str(c.get("detail"))))
lines.append(f"- {secs} s in all")
open(f"{out}/gpu_check.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(fails)
EOF
