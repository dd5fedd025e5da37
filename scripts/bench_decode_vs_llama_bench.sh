#!/usr/bin/env bash
# Single-stream decoding of one GGUF against llama.cpp's llama-bench, interleaved round by
# round (this VM drifts between runs): our `bench decode --n 1` (128 tokens after a ~200-token
# prompt, prompt reuse off; raw text for a base model) for each weight format named, then
# `llama-bench -p 200 -n 128 -r 3` (pp200, tg128 from an empty context), 2 threads each.
#
#   bash scripts/bench_decode_vs_llama_bench.sh MODEL.gguf LLAMA_BIN_DIR [rounds] [formats]
# formats: a comma-separated list of `--weights` values (default `auto`). LLAMA_BIN_DIR holds
# llama-bench (a llama.cpp build: cmake -B build -DLLAMA_CURL=OFF && cmake --build build
# --target llama-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?a .gguf file}
bin=${2:?directory with llama-bench}
rounds=${3:-2}
formats=${4:-auto}
[ -x target/release/bench ] || cargo build --release --bin bench
for r in $(seq "$rounds"); do
  for w in ${formats//,/ }; do
    echo "== round $r: ours (--weights $w)"
    target/release/bench decode --model "$model" --threads 2 --n 1 --weights "$w" | tail -1
  done
  echo "== round $r: llama-bench"
  "$bin/llama-bench" -m "$model" -t 2 -p 200 -n 128 -r 3 -o md
done
