#!/usr/bin/env bash
# Prints the folders (joined by ':') of the CUDA libraries candle loads at run time — cuBLAS,
# cuBLASLt, cuRAND, NVRTC, the runtime — found in python3's site-packages (NVIDIA's wheels,
# as PyTorch installs them), for LD_LIBRARY_PATH on a GPU machine whose loader path has none.
python3 - <<'PY'
import glob, os, site
dirs = set()
for root in site.getsitepackages():
    for pat in ("libcublas.so*", "libcurand.so*", "libcublasLt.so*", "libnvrtc.so*", "libcudart.so*"):
        for f in glob.glob(f"{root}/nvidia/**/{pat}", recursive=True):
            dirs.add(os.path.dirname(f))
print(":".join(sorted(dirs)))
PY
