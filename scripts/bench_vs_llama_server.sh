#!/usr/bin/env bash
# BENCHMARKS.md "Against llama.cpp's server": the same greedy chat requests (distinct
# ~200-token prompts, max_tokens 64, 1, 4, 8 and 16 concurrent clients) to our local
# backend in process and to llama.cpp's own server on the same GGUF, both with 2 threads,
# interleaved round by round (this VM drifts between runs); then single-stream decode
# against llama-bench.
#
#   bash scripts/bench_vs_llama_server.sh LLAMA_BIN_DIR [rounds]
# LLAMA_BIN_DIR holds llama-server and llama-bench (a llama.cpp build: cmake -B build
# -DLLAMA_CURL=OFF && cmake --build build --target llama-server llama-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:?directory with llama-server and llama-bench}; rounds=${2:-2}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
port=8093
args=(serve-throughput --model "$model" --threads 2 --concurrency 1,4,8,16 --new-tokens 64
  --rounds 1 --prompts distinct)
for r in $(seq "$rounds"); do
  echo "== round $r: ours (in process)"
  /usr/bin/time -f "peak RSS %M kB" target/release/bench "${args[@]}"
  echo "== round $r: llama.cpp server (-np 16, continuous batching)"
  # 16 slots of 1,024 positions each: every request (~230 + 64 tokens) fits its slot.
  "$bin/llama-server" -m "$model" -t 2 -tb 2 -np 16 -c 16384 --port "$port" \
    --log-disable >/dev/null 2>&1 &
  server=$!
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 0.2
  done
  target/release/bench "${args[@]}" --endpoint "http://127.0.0.1:$port/v1"
  echo "llama-server peak RSS $(grep VmHWM /proc/$server/status | awk '{print $2}') kB"
  kill "$server"; wait "$server" 2>/dev/null || true
done
echo "== single stream: ours (bench decode, reuse off) vs llama-bench (pp200, tg128)"
for r in $(seq "$rounds"); do
  target/release/bench decode --model "$model" --threads 2 --n 1
  "$bin/llama-bench" -m "$model" -t 2 -p 200 -n 128 -r 3
done
