#!/bin/sh
# Prints the distribution packages that hold the shared libraries the given binaries load, one per line.
# The build stage runs it and the runtime stage installs exactly that list, so the same Dockerfile works on
# Debian (the CPU base) and Ubuntu (NVIDIA's CUDA bases), whose package names differ (libgrpc++1.51 vs
# libgrpc++1.51t64, ...). libcuda is not listed: the NVIDIA container runtime mounts the host's driver.
# The /metrics endpoint's libraries come out as libprometheus-cpp-core1.0, libprometheus-cpp-pull1.0 and
# libcivetweb1 (libcivetweb.so.1 and libcivetweb-cpp.so.1) on bookworm; Ubuntu 24.04 has the same names, in
# universe like gRPC (the Ubuntu side is not built here: no registry serves the CUDA images to this project).
# Both register the files under /usr/lib while ldd prints /lib (seen on bookworm), hence the merged-/usr
# candidates below.
set -eu
libs=$(for b in "$@"; do ldd "$b"; done | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u)
missing=$(for b in "$@"; do ldd "$b"; done | awk '$2 == "=>" && $3 == "not" { print $1 }' | grep -v '^libcuda\.so' || true)
if [ -n "$missing" ]; then
  echo "runtime-packages: unresolved libraries: $missing" >&2
  exit 1
fi
for lib in $libs; do
  case "$lib" in */libcuda.so*) continue ;; esac
  real=$(readlink -f "$lib")
  # With merged /usr a library is found under /lib but registered under /usr/lib, or the other way round.
  pkg=""
  for candidate in "$lib" "$real" "/usr$lib" "${lib#/usr}" "/usr$real" "${real#/usr}"; do
    pkg=$(dpkg-query -S "$candidate" 2>/dev/null | head -n1 | cut -d: -f1) && [ -n "$pkg" ] && break
  done
  if [ -z "$pkg" ]; then
    echo "runtime-packages: no package owns $lib" >&2
    exit 1
  fi
  echo "$pkg"
done | sort -u
