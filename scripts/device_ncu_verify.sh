#!/usr/bin/env bash
# ncu of verify_batch_vocab's kernels (issue 24): one rank's shard with the whole GPU to
# itself (tp=1, V=19008 = 152064 / 8, N=4, fp32), the record kernel and the owners'
# combine, for each mix and pad_bs; one log per point in $OUT (ncu-MIX-bPAD.log).
# Run from the repository root (or a clean export) on the device machine:
#     OUT=out MIXES="temperature topk50" PADS="256 8" bash scripts/device_ncu_verify.sh
# SECTIONS overrides the ncu sections (default: speed of light, warp states, launch,
# occupancy); LIMIT the seconds per point (default 90).
set -u
# shellcheck source=scripts/device_steps.sh
. "$(dirname "$0")/device_steps.sh"
sections=${SECTIONS:-SpeedOfLight WarpStateStats LaunchStats Occupancy}
sec_args=()
for s in $sections; do sec_args+=(--section "$s"); done
for mix in ${MIXES:-temperature topk50}; do
  for pad in ${PADS:-256 8}; do
    # warm-up 1 + 3 iterations; skip the first two calls' kernels (module load, warm-up)
    step "${LIMIT:-90}" "$out/ncu-$mix-b$pad.log" \
      ncu --kernel-name regex:'dp_verify_(push|push_nolist|finish)$' --launch-skip 4 \
      --launch-count 2 "${sec_args[@]}" --print-details all \
      python3 -m ipc_dpsample bench --ungated --tp 1 --num-tokens 4 --vocab 19008 \
      --pad-bs "$pad" --dtype fp32 --ops verify_batch_vocab --verify-mix "$mix" \
      --verify-baselines read_once --backends onesided --iters 3 --warmup 1 --mode eager \
      --out "/tmp/ncu-$mix-$pad"
  done
done
exit 0
