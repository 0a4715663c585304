#!/usr/bin/env bash
# SASS of the Hopper kernels without a GPU machine: compiles one head_dim's object (or a single tile shape) to an
# sm_90a cubin with this machine's nvcc and disassembles it with nvdisasm from Debian's CUDA 11.8 toolkit, then
# prints per kernel: instructions, HGMMA, R2UR, LDL/STL. CUDA 13 writes ELF ABI version 8 with a new e_flags layout,
# which the 11.8 tools refuse; the instruction encoding for sm_90 is the same, so the header is rewritten to the old
# form (ABI 7, EF_CUDA_SM90 | EF_CUDA_VIRTUAL_SM(90) | 64-bit | unified texmode = 0x5a055a) on a copy. The listing
# matches the device's cuobjdump in HGMMA, R2UR and LDL/STL counts (its instruction totals run a few percent lower).
# Read a change's SASS here before spending device time on it.
#
# Usage: kernels/bench/local_sass.sh OUT_PREFIX [d64|d128|d256 | TileShapeAlias]
#   d64 (default), d128, d256: the whole attention_sm90_d<N>.cu object (1-4 minutes).
#   A TileShape alias from tile_size_sm90.h (e.g. HopperD64N128S6P2): that shape alone, as entry "k" (~20 s).
# Writes OUT_PREFIX.sass (the listing) and OUT_PREFIX.counts. The toolkit .deb (84 MB) is fetched once from
# Debian's non-free component into ${ATTND_SASS_CACHE:-$HOME/.cache/attnd-sass}; that needs root for apt.
set -euo pipefail
out=${1:?usage: local_sass.sh OUT_PREFIX [d64|d128|d256|TileShapeAlias]}
what=${2:-d64}
repo=$(cd "$(dirname "$0")/../.." && pwd)
cache=${ATTND_SASS_CACHE:-$HOME/.cache/attnd-sass}
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
disasm=$cache/x/usr/bin/nvdisasm
src=""  # the temporary apt source, while it exists
one=""  # the one-shape translation unit, while it exists
generated=""  # the generated headers' folder, while it exists
cleanup() {
  rm -f "$one"
  [ -z "$generated" ] || rm -rf "$generated"
  if [ -n "$src" ]; then
    rm -f "$src"
    apt-get update -qq >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

if [ ! -x "$disasm" ]; then
  mkdir -p "$cache"
  src=/etc/apt/sources.list.d/zz-attnd-sass-nonfree.sources
  printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: non-free\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' > "$src"
  apt-get update -qq >/dev/null
  (cd "$cache" && apt-get download -q nvidia-cuda-toolkit >/dev/null 2>&1)
  dpkg -x "$cache"/nvidia-cuda-toolkit_*.deb "$cache/x"
  rm -f "$cache"/nvidia-cuda-toolkit_*.deb
fi

generated=$(mktemp -d)  # wgmma_sm90.h, as the build generates it
python3 "$repo/kernels/cuda/src/hopper/gen_wgmma_sm90.py" "$generated/wgmma_sm90.h"
flags=(-I"$repo/kernels/cuda/include" -I"$repo/kernels/cuda/src" -I"$generated" -I"$repo/kernels/reference/include"
       -O2 -DNDEBUG -std=c++17 "-gencode=arch=compute_90a,code=sm_90a" -cubin -x cu)
case "$what" in
  d64 | d128 | d256)
    "$nvcc" "${flags[@]}" "$repo/kernels/cuda/src/hopper/attention_sm90_$what.cu" -o "$out.cubin" ;;
  *)
    # One shape: a translation unit of its own beside the real ones, so that its includes resolve the same way.
    one=$(mktemp "$repo/kernels/cuda/src/hopper/local_sass_XXXXXX.cu")
    cat > "$one" <<EOF
#include "flash_fwd_launch_sm90.cuh"
#include "tile_size_sm90.h"
namespace attnd::kernels::hopper {
EntryList Sm90D64Entries() {
  static const KernelEntry kEntries[] = {Entry<$what>("k")};
  return ListOf(kEntries);
}
}  // namespace attnd::kernels::hopper
EOF
    "$nvcc" "${flags[@]}" "$one" -o "$out.cubin" ;;
esac

python3 - "$out.cubin" <<'EOF'
import struct, sys
path = sys.argv[1]
data = bytearray(open(path, 'rb').read())
data[8] = 7                                   # EI_ABIVERSION
struct.pack_into('<I', data, 0x30, 0x5a055a)  # e_flags of an ELF64 header
open(path, 'wb').write(data)
EOF
"$disasm" -c "$out.cubin" 2>/dev/null > "$out.sass"
rm -f "$out.cubin"
awk '/^\t\.section\t\.text\./ {if (f) print n, h, u, l, f; f = substr($2, 7); n = h = u = l = 0}
     /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++} /R2UR/ {u++} /LDL|STL/ {l++}
     END {if (f) print n, h, u, l, f}' "$out.sass" > "$out.counts"
echo "instructions HGMMA R2UR LDL/STL kernel" >&2
cat "$out.counts"
