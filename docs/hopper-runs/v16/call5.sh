# v16 call 5: hopper_trace after its setup was shared by both modes (a check that both still run).
cd .carry-hopper; export LD_LIBRARY_PATH=$PWD/lib
timeout 60 ./hopper_trace --timeline hopper_sm90_d128_m128n176s2_os 1 16384 16 1 2>&1 | head -4; echo "timeline rc=${PIPESTATUS[0]}"
timeout 60 ./hopper_trace hopper_sm90_d128_m128n128s3_osk 4 4096 16 0 2>&1 | head -4; echo "trace rc=${PIPESTATUS[0]}"
