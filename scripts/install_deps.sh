#!/usr/bin/env bash
# Installs everything attnd needs to build and test (and npm, for the checks that take their tools from it),
# from Debian's packages. Used by the README quickstart and by .ci/run; safe to run again.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
pkgs=(
  build-essential cmake ninja-build pkg-config git python3
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev
  prometheus-cpp-dev libcivetweb-dev openssl
  libjemalloc-dev
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install_deps: all packages present"
fi

# ---- The Python client's tests (client/python/tests): pytest, NumPy and torch (CPU) for Debian's python3.
# --build-only (the container image's build stage) stops here: it builds the binaries, not the tests.
if [ "${1:-}" = "--build-only" ]; then
  exit 0
fi
# ml_dtypes (NumPy bfloat16) is not packaged in Debian 12; the tests use uint16 bf16 bits without it.
py_pkgs=(python3-pytest python3-numpy python3-torch)
py_missing=()
for p in "${py_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || py_missing+=("$p")
done
if [ "${#py_missing[@]}" -gt 0 ]; then
  echo "install_deps: installing ${py_missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${py_missing[@]}"
fi

# ---- npm for the checks that take their tools from the npm registry: buf (scripts/proto_check.sh) and the
# manifest validators (scripts/validate_k8s.sh). Any npm on the PATH will do.
if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "install_deps: installing nodejs npm"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm
fi
