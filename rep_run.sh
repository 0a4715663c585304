#!/bin/bash
# temporary repeat run (not committed)
C=.carry; mkdir -p $C/u && tar -xJf $C/attnd.tar.xz -C $C/u; b=$C/u
mkdir -p client/python/attnd/lib && cp -a $C/u/pylib/. client/python/attnd/lib/
sock=/tmp/r.sock shm=/tmp/rshm.sock; rm -f $sock $shm
$b/attnd --listen=127.0.0.1:50098 --unix_socket=$sock --shm_socket=$shm --enable_cuda_ipc --log_level=warn --warm_shapes=1x1024x1024x32x32x128 > $OUT/rep_server.log 2>&1 &
srv=$!
for i in $(seq 1 150); do $b/attn info --target=unix:$sock > /dev/null 2>&1 && break; sleep 0.2; done
P="timeout 60 $b/ipc_peer decode --target=unix:$sock --shm_socket=$shm --context=4096 --steps=1000 --transport=shm"
for i in 1 2 3; do $P --decode_sequences=64 --decode_callers=2 | grep "^csv,ipc"; $P --decode_sequences=1,64 --decode_callers=1 | grep "^csv,ipc"; done
for i in 1 2 3; do
  timeout 60 $b/ipc_peer bench --target=unix:$sock --transport=shm --shm_socket=$shm --seqs=1024 --concurrency=1 --duration_s=2 --warmup_s=0.5 | grep "^csv,ipc_shm"
  PYTHONPATH=$PWD/client/python PYTHONDONTWRITEBYTECODE=1 timeout 100 python3 client/python/bench/overhead.py --target unix:$sock --shm-socket $shm --seq 1024 --what forward
done
kill -TERM $srv; wait $srv; echo exit=$?
