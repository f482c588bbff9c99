# runs 4 to 7: four more calls on one H100 (07:29 to 07:34 UTC), the working tree at
# cc98673 (main; its kernels are 91013c7's), each command line as it ran
# run 4 (fresh machine):
nvidia-smi -L > $OUT/misc.log; git rev-parse --short HEAD >> $OUT/misc.log 2>/dev/null; OUT=$OUT SOURCE=1 MIXES=topk50 PADS="8" LIMIT=120 bash scripts/device_ncu_verify.sh; tail -5 $OUT/ncu-src.log; python3 scripts/ncu_sass_summary.py $OUT/src-topk50-b8-sass.csv.gz --window 40 --top 15 2>&1 | head -80
# run 5:
OUT=$OUT SOURCE=1 MIXES=topk50 PADS="256" LIMIT=120 bash scripts/device_ncu_verify.sh >/dev/null; tail -2 $OUT/ncu-src.log; python3 scripts/ncu_sass_summary.py $OUT/src-topk50-b256-sass.csv.gz --window 40 --top 20 2>&1 | head -60; grep -i "duration\|elapsed cycles" $OUT/ncu-src.log | head -4
# run 6:
. scripts/device_steps.sh >/dev/null; COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"; B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"; for u in 2 4 2 4; do [ $SECONDS -lt 200 ] && IPC_DPSAMPLE_VERIFY_UNROLL=$u step 45 $OUT/unroll.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50 >/dev/null; echo "unroll $u done at $SECONDS" >> $OUT/unroll.log; done; grep -h "verify_batch_vocab \[\|unroll\|no point" $OUT/unroll.log | cut -c 20-200
# run 7:
. scripts/device_steps.sh >/dev/null; COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"; B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"; for m in topk50 temperature; do for u in 2 4; do [ $SECONDS -lt 80 ] && IPC_DPSAMPLE_VERIFY_UNROLL=$u step 30 $OUT/unroll8.log python3 -m ipc_dpsample bench $B8 --verify-mix $m >/dev/null; echo "unroll $u $m done at $SECONDS" >> $OUT/unroll8.log; done; done; grep -h "verify_batch_vocab \[\|argmax_batch_vocab float\|unroll\|no point" $OUT/unroll8.log | cut -c 20-200
