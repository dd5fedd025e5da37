#!/usr/bin/env bash
# Quick start: fetch the embedded default model, build, and run generate_conv on the bundled
# math sample with the default model in every role (configs/quickstart.toml).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/fetch_default_model.sh
cargo build --release --bin generate_conv
target/release/generate_conv --config configs/quickstart.toml "$@"
