#!/usr/bin/env bash
# Copies what the GPU machine needs into .carry/ (ignored by git; name it in the device call's `carry`):
# the static gpu_attention_test (build-kernels-static) and libattnd_kernels_c.so (build-kernels) with the
# abseil shared libraries it needs, which the GPU image lacks (found there through the .so's $ORIGIN runpath).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .carry
cp build-kernels-static/tests/gpu_attention_test .carry/
strip .carry/gpu_attention_test
cp build-kernels/kernels/cuda/libattnd_kernels_c.so .carry/
ldd .carry/libattnd_kernels_c.so | awk '/libabsl_/ {print $3}' | xargs -r -I{} cp -L {} .carry/
du -sh .carry
