#!/usr/bin/env bash
# Checks that the `--features cuda` build compiles, on a machine without a GPU: installs a CUDA
# toolkit (nvcc, the device front end, runtime headers) from NVIDIA's Python registry wheels
# into a cache directory, then runs `cargo check --features cuda --all-targets` in its own
# target directory (the CPU build's is left alone). The candle CUDA kernels are compiled to PTX
# for one architecture by the build scripts; nothing is linked or run.
#
# Usage: bash scripts/check_cuda_build.sh [--build]
#   --build   a full `cargo build --features cuda` of the binaries instead of `cargo check`
#             (linked against stubs of the CUDA libraries; much longer), to run on a GPU
#             machine: `CUDA_RELEASE=13.0 CUDA_COMPUTE_CAP=90 bash scripts/check_cuda_build.sh
#             --build` for an H100 whose driver runs CUDA 13.0, then scripts/check_cuda_run.sh.
# Environment: CUDA_WHEELS_DIR (cache, default ~/.cache/collabllm-cuda), CUDA_COMPUTE_CAP
# (default 80), CUDA_RELEASE (toolkit release, default 13.4: to run the build on a GPU, use
# the release its driver supports or older, since the driver cannot JIT newer PTX), PYTHON
# (default python3), JOBS (default: cargo's).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode=check
[[ "${1:-}" == "--build" ]] && mode=build
cache="${CUDA_WHEELS_DIR:-$HOME/.cache/collabllm-cuda}"
python="${PYTHON:-python3}"
# The toolkit release cudarc (candle 0.11's CUDA binding) knows; keep in step with Cargo.lock.
release="${CUDA_RELEASE:-13.4}"
root="$cache/cu${release}/nvidia/cu13"

if [[ ! -x "$root/bin/nvcc" ]]; then
  echo "== installing the CUDA $release toolkit wheels into $cache"
  mkdir -p "$cache/wheels-$release"
  "$python" -m pip download --quiet --no-deps -d "$cache/wheels-$release" \
    "nvidia-cuda-nvcc==$release.*" "nvidia-cuda-crt==$release.*" "nvidia-nvvm==$release.*" \
    "nvidia-cuda-runtime==$release.*" "nvidia-cuda-cccl<${release%.*}.$(( ${release#*.} + 1 ))"
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
  # candle links the CUDA libraries by name (cudarc's dynamic-linking); the wheels above hold
  # only the runtime. Stub libraries with the real names and SONAMEs, defining every CUDA
  # function the compiled crates reference, let the binaries link here; on a GPU machine
  # the loader finds the real ones (`scripts/check_cuda_run.sh` sets the path).
  cargo build --release --features cuda --lib --target-dir target/cuda-check "${jobs[@]}"
  out=target/cuda-check/release stubs=target/cuda-check/link-stubs
  rm -rf "$stubs" && mkdir -p "$stubs"
  for f in "$out"/deps/lib{cudarc,candle_core,candle_nn,collabllm}-*.rlib "$out"/build/candle-kernels-*/out/libmoe.a; do
    nm -u --no-demangle "$f" 2>/dev/null || true
  done | awk '{print $2}' | grep -E '^(cu|nvrtc|curand|cublas)' | sort -u |
    while read -r sym; do
      case $sym in
        cuda*) ;; # the runtime: the real library from the wheels
        cublasLt*) echo "void $sym(void) {}" >> "$stubs/cublasLt.c" ;;
        cublas*) echo "void $sym(void) {}" >> "$stubs/cublas.c" ;;
        curand*) echo "void $sym(void) {}" >> "$stubs/curand.c" ;;
        nvrtc*) echo "void $sym(void) {}" >> "$stubs/nvrtc.c" ;;
        *) echo "void $sym(void) {}" >> "$stubs/cuda.c" ;;
      esac
    done
  for lib in cuda:libcuda.so.1 nvrtc:libnvrtc.so.13 curand:libcurand.so.10 \
    cublas:libcublas.so.13 cublasLt:libcublasLt.so.13; do
    name=${lib%%:*}
    touch "$stubs/$name.c"
    cc -shared -fPIC -w -o "$stubs/lib$name.so" "$stubs/$name.c" -Wl,-soname,"${lib#*:}"
  done
  ln -sf "$(realpath "$root/lib/libcudart.so.13")" "$stubs/libcudart.so"
  export LIBRARY_PATH="$stubs:$root/lib:${LIBRARY_PATH:-}"
  cargo build --release --features cuda --bins --target-dir target/cuda-check "${jobs[@]}"
fi
echo "cuda $mode passed in $(( $(date +%s) - started )) s (CUDA $release, sm_$CUDA_COMPUTE_CAP)"
