# v16 call 1: per-block timelines (hopper_trace --timeline) of the split tail on and off.
# Run from the repository root on the device with .carry-hopper/hopper_trace carried.
set -u
cd .carry-hopper
export LD_LIBRARY_PATH=$PWD/lib
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/device.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 100 > $OUT/smi.csv &
SMI=$!
for rep in 1 2; do
  for split in 1 0; do
    echo "### rep $rep ATTND_HOPPER_SPLIT_TAIL=$split" >> $OUT/timeline.txt
    ATTND_HOPPER_SPLIT_TAIL=$split ./hopper_trace --timeline \
      hopper_sm90_d128_m128n176s2_os 1 16384 16 1 \
      hopper_sm90_d128_m128n176s2_os 1 16384 16 0 \
      hopper_sm90_d128_m128n128s3_osk 2 8192 16 1 \
      hopper_sm90_d128_m128n128s3 2 8192 16 1 >> $OUT/timeline.txt 2>&1
    echo "rc=$?" >> $OUT/timeline.txt
  done
done
kill $SMI
tail -c 3000 $OUT/timeline.txt
