#!/usr/bin/env bash
# Quick start: fetch the embedded default model, build, serve it on 127.0.0.1 and ask it one
# question through the OpenAI-compatible API.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/fetch_default_model.sh
cargo build --release --bin serve
port="${PORT:-8765}"
target/release/serve --model default --port "$port" --threads "${THREADS:-2}" &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 60); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 0.5
done
curl -sf "http://127.0.0.1:$port/v1/chat/completions" \
  -H 'content-type: application/json' \
  -d '{"model": "default", "temperature": 0, "max_tokens": 64,
       "messages": [{"role": "user", "content": "Say hello in one short sentence."}]}' |
  python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["choices"][0]["message"]["content"]); print(r["usage"])'
