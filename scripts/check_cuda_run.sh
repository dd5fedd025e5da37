#!/usr/bin/env bash
# Runs the `--features cuda` build on an NVIDIA GPU and checks it against the CPU build of the
# same binaries: `dpo_train` (full and LoRA) and `rl_train` (GRPO) for a few steps on the same
# model and data with `--device cpu` and `--device cuda --dtype f32`, then bf16; compares the
# logged loss, grad_norm and log-probs step by step and the final weights of the full runs,
# and loads the CUDA-trained checkpoint in transformers (every parameter finite).
#
# Usage: bash scripts/check_cuda_run.sh BIN_DIR TOKENIZER_DIR DATA_DIR OUT_DIR
#   BIN_DIR        dpo_train and rl_train built with `check_cuda_build.sh --build`, for a
#                  CUDA release the GPU's driver supports (CUDA_RELEASE) and its compute
#                  capability (CUDA_COMPUTE_CAP)
#   TOKENIZER_DIR  config.json, tokenizer.json and tokenizer_config.json of the model shape to
#                  test (a `dpo_train` checkpoint of `default` has them); the weights are
#                  drawn at random here with PyTorch (seed 0), so nothing large travels
#   DATA_DIR       a generate_conv run (its pairs/ are trained on); rl_train samples
#                  data/math.jsonl (run from the repository's root)
#   OUT_DIR        logs and the summary (summary.txt)
# Needs: nvidia-smi, python3 with torch, transformers and safetensors, the CUDA libraries
# cudarc loads at run time (cuBLAS, cuRAND; found under python3's site-packages if not on
# the loader's path). Each comparison prints PASS or FAIL; the exit status counts FAILs.
set -uo pipefail
bin=$(realpath "$1") tok=$(realpath "$2") data=$(realpath "$3") out=$(realpath -m "$4")
mkdir -p "$out"
work=$(mktemp -d)
fails=0
say() { echo "$*" | tee -a "$out/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
libs=$(bash "$(dirname "${BASH_SOURCE[0]}")/cuda_lib_path.sh")
export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
threads=$(nproc)

# A model of the given shape with random weights (PyTorch's init, seed 0), in f32.
model="$work/model"
python3 - "$tok" "$model" <<'EOF'
import shutil, sys, torch
from transformers import AutoConfig, LlamaForCausalLM
src, dst = sys.argv[1], sys.argv[2]
cfg = AutoConfig.from_pretrained(src)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(dst, safe_serialization=True)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"{src}/{f}", f"{dst}/{f}")
EOF

# `run NAME CMD...`: runs a binary with its own copy of the data (the reference log-probs
# cache lives beside it), logging and timing it.
run() {
  local name=$1
  shift
  cp -r "$data" "$work/data-$name"
  local t0 rc ms
  t0=$(date +%s%N)
  "$@" > "$out/$name.log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  say "$(printf '%-16s exit %d in %d.%03d s' "$name" "$rc" $((ms / 1000)) $((ms % 1000)))"
  [[ $rc == 0 ]] || { fails=$((fails + 1)); tail -5 "$out/$name.log"; }
}
dpo() {
  local name=$1 device=$2 dtype=$3
  shift 3
  run "$name" "$bin/dpo_train" --data "$work/data-$name" --model "$model" \
    --output "$work/$name" --max-steps 4 --batch-size 2 --lr 1e-4 --warmup-ratio 0 \
    --schedule constant --logging-steps 1 --eval-steps 100 --save-steps 100 \
    --device "$device" --dtype "$dtype" --threads "$threads" "$@"
}
rl() {
  local name=$1 device=$2
  shift 2
  run "$name" "$bin/rl_train" --tasks data/math.jsonl --max-tasks 4 --model "$model" \
    --user "$model" --judge "$model" \
    --output "$work/$name" --opening task --samples 0 --metric token_amount=-1 \
    --batch-prompts 2 --group-size 4 --max-new-tokens 24 --max-steps 2 --lr 1e-4 \
    --lora-r 8 --lora-alpha 16 --entropy-coef 0.01 --seed 1 --device "$device" \
    --sampler-weights f32 --threads "$threads" "$@"
}

dpo dpo-cpu cpu f32
dpo dpo-cuda cuda f32
dpo dpo-cuda-bf16 cuda bf16
dpo lora-cpu cpu f32 --lora
dpo lora-cuda cuda f32 --lora
dpo lora-cuda-bf16 cuda bf16 --lora
# Near-greedy (T = 0.01), so that both devices roll out the same responses: at temperature 1
# near-uniform random weights let the GPU's softmax (other sums, other last bits) pick other
# tokens, and the runs part at once. Near-greedy groups have little reward spread, so these
# updates are mostly the entropy bonus; the sampled run on the GPU checks the rest runs.
rl rl-cpu cpu --temperature 0.01
rl rl-cuda cuda --temperature 0.01
rl rl-cuda-sampled cuda
for f in "$work"/*/logs.jsonl; do
  d=$(basename "$(dirname "$f")")
  cp "$f" "$out/$d.logs.jsonl"
done

# Step-by-step agreement, final weights, and the CUDA checkpoint read by transformers.
python3 - "$work" "$model" "$data" <<'EOF' | tee -a "$out/summary.txt"
import json, sys, os, math
import torch
from safetensors.torch import load_file
work, model, data = sys.argv[1:4]

def steps(run):
    p = f"{work}/{run}/logs.jsonl"
    if not os.path.exists(p):
        return []
    rows = [json.loads(l) for l in open(p)]
    return [r for r in rows if not any(k.startswith("eval_") for k in r)]

fails = 0
def check(name, ok, detail):
    global fails
    fails += 0 if ok else 1
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")

def compare(a, b, keys, tol, upto=None, floor=0.1):
    ra, rb = steps(a), steps(b)
    if not ra or not rb:
        check(f"{a} vs {b}", False, "missing logs")
        return
    n = min(len(ra), len(rb)) if upto is None else min(upto, len(ra), len(rb))
    worst = {}
    for x, y in zip(ra[:n], rb[:n]):
        for k in keys:
            if k in x and k in y:
                # Relative, with a floor: margins and losses near 0 are compared absolutely.
                d = abs(x[k] - y[k]) / max(abs(x[k]), floor)
                worst[k] = max(worst.get(k, 0.0), d)
    detail = ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    check(f"{a} vs {b} ({n} steps, worst relative difference)",
          bool(worst) and all(v <= tol for v in worst.values()), detail)

keys = ["loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins"]
compare("dpo-cpu", "dpo-cuda", keys, 1e-3)
# bf16 against f32 on the same starting weights only (the runs then part, as bf16 updates do).
bf16 = ["loss", "logps/chosen", "logps/rejected"]
compare("dpo-cpu", "dpo-cuda-bf16", bf16, 1e-2, upto=1)
compare("lora-cpu", "lora-cuda", keys, 1e-3)
compare("lora-cpu", "lora-cuda-bf16", bf16, 1e-2, upto=1)
for run in ("dpo-cpu", "dpo-cuda", "dpo-cuda-bf16", "lora-cpu", "lora-cuda", "lora-cuda-bf16"):
    rows = steps(run)
    if rows:
        print(f"     {run}: losses " + " ".join(f"{r['loss']:.4f}" for r in rows)
              + " · tokens/s by step " + " ".join(f"{r.get('tokens_per_second', 0):.0f}" for r in rows))
# The sampler runs where the policy trains (f32 weights on both). Only the first step: the
# second samples from weights one update apart in the last bits, and near-greedy picks part.
compare("rl-cpu", "rl-cuda", ["actor/response_tokens", "actor/reward_mean", "actor/loss",
        "actor/grad_norm", "actor/entropy"], 1e-3, upto=1, floor=1e-6)
sampled = steps("rl-cuda-sampled")
check("rl-cuda-sampled", len(sampled) == 2 and all(
    math.isfinite(r["actor/loss"]) and r["actor/grad_norm"] > 0 for r in sampled),
    "two sampled GRPO steps on the GPU, finite losses, nonzero gradients: "
    + " ".join(f"{r['actor/loss']:.4f}/{r['actor/grad_norm']:.3f}" for r in sampled))

def final(run):
    return load_file(f"{work}/{run}/final/model.safetensors")
try:
    base, a, b = load_file(f"{model}/model.safetensors"), final("dpo-cpu"), final("dpo-cuda")
    worst = 0.0
    for name, w in a.items():
        da, db = (w - base[name]).float(), (b[name] - base[name]).float()
        scale = da.norm().item()
        if scale > 0:
            worst = max(worst, (da - db).norm().item() / scale)
    check("dpo final weights: cuda's update vs cpu's", worst < 1e-2,
          f"worst relative difference of a tensor's update {worst:.1e}")
except Exception as e:
    check("dpo final weights", False, repr(e))

# Our logged log-probs of the CUDA-trained checkpoint's first pair against transformers'.
try:
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(f"{work}/dpo-cuda/final", dtype=torch.float32).cuda()
    n = sum(p.numel() for p in m.parameters())
    finite = all(torch.isfinite(p).all().item() for p in m.parameters())
    check("transformers loads the CUDA checkpoint", finite, f"{n/1e6:.1f} M parameters, all finite")
except Exception as e:
    check("transformers loads the CUDA checkpoint", False, repr(e))
print(f"FAILS {fails}")
EOF
fails=$((fails + $(grep -c '^FAIL ' "$out/summary.txt" || true)))
grep -h "tokens/s\|steps/s\|trained" "$out"/*.log >> "$out/summary.txt" 2>/dev/null || true
rm -rf "$work"
exit "$fails"
