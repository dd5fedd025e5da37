#!/usr/bin/env bash
# Checks that the `--features cuda` build compiles, on a machine without a GPU: installs a CUDA
# toolkit (nvcc, the device front end, runtime headers) from NVIDIA's Python registry wheels
# into a cache directory, then runs `cargo check --features cuda --all-targets` in its own
# target directory (the CPU build's is left alone). The candle CUDA kernels are compiled to PTX
# for one architecture by the build scripts; nothing is linked or run.
#
# Usage: bash scripts/check_cuda_build.sh [--build]
#   --build   a full `cargo build --features cuda` of the binaries instead of `cargo check`
#             (links against the toolkit's stub libraries; much longer).
# Environment: CUDA_WHEELS_DIR (cache, default ~/.cache/collabllm-cuda), CUDA_COMPUTE_CAP
# (default 80), PYTHON (default python3), JOBS (default: cargo's).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode=check
[[ "${1:-}" == "--build" ]] && mode=build
cache="${CUDA_WHEELS_DIR:-$HOME/.cache/collabllm-cuda}"
python="${PYTHON:-python3}"
# The toolkit release cudarc (candle 0.11's CUDA binding) knows; keep in step with Cargo.lock.
release=13.4
root="$cache/cu${release}/nvidia/cu13"

if [[ ! -x "$root/bin/nvcc" ]]; then
  echo "== installing the CUDA $release toolkit wheels into $cache"
  mkdir -p "$cache/wheels-$release"
  "$python" -m pip download --quiet --no-deps -d "$cache/wheels-$release" \
    "nvidia-cuda-nvcc==$release.*" "nvidia-cuda-crt==$release.*" "nvidia-nvvm==$release.*" \
    "nvidia-cuda-runtime==$release.*" "nvidia-cuda-cccl"
  for w in "$cache/wheels-$release"/*.whl; do
    "$python" -m zipfile -e "$w" "$cache/cu$release/"
  done
  chmod +x "$root"/bin/* "$root"/nvvm/bin/*
fi
"$root/bin/nvcc" --version | tail -1

export PATH="$root/bin:$PATH" CUDA_ROOT="$root" CUDA_PATH="$root" CUDA_HOME="$root"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
export CUDARC_CUDA_VERSION="${release/./0}0"
jobs=()
[[ -n "${JOBS:-}" ]] && jobs=(-j "$JOBS")
started=$(date +%s)
if [[ $mode == check ]]; then
  cargo check --release --features cuda --all-targets --target-dir target/cuda-check "${jobs[@]}"
else
  export LIBRARY_PATH="$root/lib:$root/lib/stubs:${LIBRARY_PATH:-}"
  cargo build --release --features cuda --bins --target-dir target/cuda-check "${jobs[@]}"
fi
echo "cuda $mode passed in $(( $(date +%s) - started )) s (CUDA $release, sm_$CUDA_COMPUTE_CAP)"
