#!/usr/bin/env bash
# SASS of the Hopper kernels without a GPU machine: compiles one head_dim's object (or a single configuration) to an
# sm_90a cubin with this machine's nvcc and disassembles it with nvdisasm from Debian's CUDA 11.8 toolkit, then
# prints per kernel: instructions, HGMMA, R2UR, LDL/STL, and the instructions 11.8 cannot decode (it leaves them out
# of the listing; a float8 kernel's QGMMA are among them). CUDA 13 writes ELF ABI version 8 with a new e_flags layout,
# which the 11.8 tools refuse; the instruction encoding for sm_90 is the same, so the header is rewritten to the old
# form (ABI 7, EF_CUDA_SM90 | EF_CUDA_VIRTUAL_SM(90) | 64-bit | unified texmode = 0x5a055a) on a copy. The listing
# matches the device's cuobjdump in HGMMA, R2UR and LDL/STL counts (its instruction totals run a few percent lower).
# Read a change's SASS here before spending device time on it.
#
# Usage: kernels/bench/local_sass.sh OUT_PREFIX [d64|d128|d256 | Configuration] [--same-as REV]
#   d64 (default), d128, d256: the whole attention_sm90_d<N>.cu object (1-4 minutes).
#   A configuration from tile_size_sm90.h (e.g. HopperD64M128N128S6P2): that shape alone, as entry "k" (~20 s).
#   --same-as REV (whole objects only): also compiles the object at revision REV and compares each kernel's machine
#   code byte for byte, so a change meant to leave some kernels alone (an `if constexpr` feature off in them) can be
#   shown to. Writes OUT_PREFIX.same: "identical", "params" (the same instructions with the kernel parameters at
#   other offsets), "differs", "new" or "gone" per kernel; exits 3 if any differs.
# Writes OUT_PREFIX.sass (the listing) and OUT_PREFIX.counts. The toolkit .deb (84 MB) is fetched once from
# Debian's non-free component into ${ATTND_SASS_CACHE:-$HOME/.cache/attnd-sass}; that needs root for apt.
set -euo pipefail
usage="usage: local_sass.sh OUT_PREFIX [d64|d128|d256|Configuration] [--same-as REV]"
out=${1:?$usage}
what=d64
base_rev=""
shift
while [ $# -gt 0 ]; do
  case $1 in
    --same-as) base_rev=${2:?$usage}; shift ;;
    -*) echo "$usage" >&2; exit 2 ;;
    *) what=$1 ;;
  esac
  shift
done
repo=$(cd "$(dirname "$0")/../.." && pwd)
if [ -n "$base_rev" ]; then
  case "$what" in d64 | d128 | d256) ;; *) echo "--same-as compares whole objects (d64, d128, d256)" >&2; exit 2 ;; esac
  if ! git -C "$repo" rev-parse --verify -q "$base_rev^{commit}" > /dev/null; then
    echo "--same-as: no revision $base_rev" >&2
    exit 2
  fi
fi
cache=${ATTND_SASS_CACHE:-$HOME/.cache/attnd-sass}
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
disasm=$cache/x/usr/bin/nvdisasm
src=""  # the temporary apt source, while it exists
one=""  # the one-shape translation unit, while it exists
generated=""  # the generated headers' folder, while it exists
base_tree=""  # REV's kernels/ (--same-as), while it exists
cleanup() {
  rm -f "$one"
  [ -z "$generated" ] || rm -rf "$generated"
  [ -z "$base_tree" ] || rm -rf "$base_tree"
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

# compile ROOT CUBIN: ROOT's object (or the one configuration) as an sm_90a cubin, with ROOT's generated wgmma_sm90.h.
compile() {
  local root=$1 cubin=$2 gen
  gen=$generated/$(basename "$cubin")
  mkdir -p "$gen"
  python3 "$root/kernels/cuda/src/hopper/gen_wgmma_sm90.py" "$gen/wgmma_sm90.h"
  local flags=(-I"$root/kernels/cuda/include" -I"$root/kernels/cuda/src" -I"$gen" -I"$root/kernels/reference/include"
               -O2 -DNDEBUG -std=c++17 "-gencode=arch=compute_90a,code=sm_90a" -cubin -x cu)
  case "$what" in
    d64 | d128 | d256)
      "$nvcc" "${flags[@]}" "$root/kernels/cuda/src/hopper/attention_sm90_$what.cu" -o "$cubin" ;;
    *)
      # One shape: a translation unit of its own beside the real ones, so that its includes resolve the same way.
      one=$(mktemp "$root/kernels/cuda/src/hopper/local_sass_XXXXXX.cu")
      cat > "$one" <<EOF
#include "flash_fwd_launch_sm90.cuh"
#include "tile_size_sm90.h"
namespace attnd::kernels::hopper {
EntryList Sm90D64Entries() {
  static const KernelEntry kEntries[] = {Entry<TileShape<$what>>("k")};
  return ListOf(kEntries);
}
}  // namespace attnd::kernels::hopper
EOF
      "$nvcc" "${flags[@]}" "$one" -o "$cubin" ;;
  esac
}

generated=$(mktemp -d)  # the generated headers, one folder per cubin
compile "$repo" "$out.cubin"
if [ -n "$base_rev" ]; then
  base_tree=$(mktemp -d)
  git -C "$repo" archive "$base_rev" kernels | tar -x -C "$base_tree"
  compile "$base_tree" "$out.base.cubin"
fi

# disassemble CUBIN LISTING: with the header rewritten on a copy (the top of this file says why).
disassemble() {
  python3 - "$1" "$1.v7" <<'EOF'
import struct, sys
data = bytearray(open(sys.argv[1], 'rb').read())
data[8] = 7                                   # EI_ABIVERSION
struct.pack_into('<I', data, 0x30, 0x5a055a)  # e_flags of an ELF64 header
open(sys.argv[2], 'wb').write(data)
EOF
  "$disasm" -c "$1.v7" 2>/dev/null > "$2"
  rm -f "$1.v7"
}
disassemble "$out.cubin" "$out.sass"
same=0
if [ -n "$base_rev" ]; then
  disassemble "$out.base.cubin" "$out.base.sass"
  # Each kernel's .text section, byte for byte: the machine code, whatever the listing can decode. Where the bytes
  # differ but the listings agree once the kernel parameters' constant-bank offsets are masked, the change moved
  # LaunchParams' fields and nothing else: "params".
  python3 - "$out.base.cubin" "$out.cubin" "$out.base.sass" "$out.sass" "$base_rev" > "$out.same" <<'EOF' || same=$?
import re, struct, sys

def kernels(path):
    b = open(path, 'rb').read()
    shoff, = struct.unpack_from('<Q', b, 0x28)
    size, count, names = struct.unpack_from('<HHH', b, 0x3a)
    hdrs = [struct.unpack_from('<IIQQQQIIQQ', b, shoff + i * size) for i in range(count)]
    strtab = hdrs[names][4]
    def name(off):
        return b[strtab + off:b.index(b'\0', strtab + off)].decode()
    return {name(h[0])[6:]: b[h[4]:h[4] + h[5]] for h in hdrs if name(h[0]).startswith('.text.')}

def listings(path):
    out = {}
    for sec in re.split(r'\n\t\.section\t\.text\.', open(path).read())[1:]:
        lines = re.findall(r'^ +/\*([0-9a-f]+)\*/ +(.*)$', sec, re.M)
        ops = [(int(a, 16), re.sub(r'c\[0x0\]\[0x[0-9a-f]+\]', 'c[0x0][param]', o)) for a, o in lines]
        out[sec.split('\n', 1)[0].split(',')[0]] = ops
    return out

# The same instructions at the same addresses once parameter offsets are masked, and the slots the listing leaves
# out (which it cannot compare) the same bytes.
def only_params(a_bytes, b_bytes, a_ops, b_ops):
    if len(a_bytes) != len(b_bytes) or a_ops is None or a_ops != b_ops:
        return False
    decoded = {addr for addr, _ in a_ops}
    return all(a_bytes[i:i + 16] == b_bytes[i:i + 16] for i in range(0, len(a_bytes), 16) if i not in decoded)

base, new = kernels(sys.argv[1]), kernels(sys.argv[2])
base_sass, new_sass = listings(sys.argv[3]), listings(sys.argv[4])
differ = 0
for k in sorted(set(base) | set(new)):
    if k not in base or k not in new:
        state = 'new' if k not in base else 'gone'
    elif base[k] == new[k]:
        state = 'identical'
    elif only_params(base[k], new[k], base_sass.get(k), new_sass.get(k)):
        state = 'params'
    else:
        state = 'differs'
        differ += 1
    print(f'{state:9s} {k}')
print(f"{differ} of {len(set(base) & set(new))} kernels in both differ from {sys.argv[5]}'s", file=sys.stderr)
sys.exit(3 if differ else 0)
EOF
  rm -f "$out.base.cubin" "$out.base.sass"
fi
rm -f "$out.cubin"
# Undecoded: the 16-byte slots between a kernel's first and last address that the listing leaves out.
python3 - "$out.sass" > "$out.counts" <<'EOF'
import re, sys
for sec in re.split(r'\n\t\.section\t\.text\.', open(sys.argv[1]).read())[1:]:
    name = sec.split('\n', 1)[0].split(',')[0]
    lines = re.findall(r'^ +/\*([0-9a-f]+)\*/ +(.*)$', sec, re.M)
    if not lines:
        continue
    ops = [op for _, op in lines]
    undecoded = (int(lines[-1][0], 16) - int(lines[0][0], 16)) // 16 + 1 - len(lines)
    def count(pattern):
        return sum(1 for op in ops if re.search(pattern, op))
    print(len(lines), count('HGMMA'), count('R2UR'), count('LDL|STL'), undecoded, name)
EOF
echo "instructions HGMMA R2UR LDL/STL undecoded kernel" >&2
cat "$out.counts"
[ -z "$base_rev" ] || cat "$out.same"
exit "$same"
