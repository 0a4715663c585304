#!/usr/bin/env bash
# Session 22, call 4: the final library (68253f4: registry entries carry `split_tail`; kernels unchanged since 12d16e2)
# through kernel_registry_test and the whole gpu_attention_test binary on the H200. .carry-hopper: t39, v39/,
# kernel_registry_test, lib/ (the abseil .so files).
set -u
C=.carry-hopper; W=/tmp/s22c4; mkdir -p $W
trap 'tar czf $OUT/s22c4.tgz -C /tmp s22c4' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]' "$1" | head -12; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
$C/kernel_registry_test > $W/registry.log 2>&1; echo "kernel_registry_test rc=$?"; pass $W/registry.log
timeout 500 $C/t39 > $W/suite.log 2>&1; echo "gpu_attention_test rc=$? t=$SECONDS"; pass $W/suite.log
