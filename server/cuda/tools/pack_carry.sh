#!/usr/bin/env bash
# Packs the statically linked binaries of build-cuda-static into .carry-cuda/bins.tar.xz (stripped and
# compressed to fit the device tool's transfer limit) for server/cuda/tools/device_run.sh.
set -euo pipefail
cd "$(dirname "$0")/../../.."
B=${BUILD_DIR:-build-cuda-static}
rm -rf .carry-cuda && mkdir -p .carry-cuda/stage
for f in server/attnd client/attn tests/ipc_peer tests/gpu_server_parts_test tests/gpu_server_forward_test \
         tests/gpu_server_ipc_test; do
  strip -o ".carry-cuda/stage/$(basename $f)" "$B/$f"
done
tar cJf .carry-cuda/bins.tar.xz -C .carry-cuda/stage .
rm -rf .carry-cuda/stage
git rev-parse --short HEAD > .carry-cuda/commit
ls -la .carry-cuda
