#!/usr/bin/env bash
# ncu of verify_batch_vocab's kernels (issue 24): one rank's shard with the whole GPU to
# itself (tp=1, V=19008 = 152064 / 8, N=4, fp32), the record kernel and the owners'
# combine, for each mix and pad_bs; one log per point in $OUT (ncu-MIX-bPAD.log).
# Run from the repository root (or a clean export) on the device machine:
#     OUT=out MIXES="temperature topk50" PADS="256 8" bash scripts/device_ncu_verify.sh
# SECTIONS overrides the ncu sections (default: speed of light, warp states, launch,
# occupancy); LIMIT the seconds per point (default 90). SOURCE=1 profiles the record
# kernel alone, built with -lineinfo, with the source counters, and writes the
# instructions and stall samples per SASS instruction (src-MIX-bPAD-sass.csv.gz; NVRTC
# keeps no source file, so ncu has no CUDA-line view of these kernels) instead;
# scripts/ncu_sass_summary.py reads it anywhere (no GPU needed).
set -u
# shellcheck source=scripts/device_steps.sh
. "$(dirname "$0")/device_steps.sh"
sections=${SECTIONS:-SpeedOfLight WarpStateStats LaunchStats Occupancy}
sec_args=()
for s in $sections; do sec_args+=(--section "$s"); done
bench_args() {  # bench_args MIX PAD
  echo python3 -m ipc_dpsample bench --ungated --tp 1 --num-tokens 4 --vocab 19008 \
    --pad-bs "$2" --dtype "${DTYPE:-fp32}" --ops verify_batch_vocab --verify-mix "$1" \
    --verify-baselines read_once --backends onesided --iters 3 --warmup 1 --mode eager \
    --out "/tmp/ncu-$1-$2"
}
if [ "${SOURCE:-0}" = 1 ]; then
  for mix in ${MIXES:-temperature topk50}; do
    for pad in ${PADS:-256}; do
      rep=/tmp/src-$mix-b$pad
      # shellcheck disable=SC2046
      IPC_DPSAMPLE_LINEINFO=1 step "${LIMIT:-120}" "$out/ncu-src.log" \
        ncu --kernel-name regex:'dp_verify_(push|push_nolist)$' --launch-skip 2 \
        --launch-count 1 --section SourceCounters --section WarpStateStats \
        --section InstructionStats --section SpeedOfLight --import-source yes -f -o "$rep" \
        $(bench_args "$mix" "$pad")
      ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2>&1 |
        gzip > "$out/src-$mix-b$pad-sass.csv.gz"
      ncu -i "$rep.ncu-rep" --print-details all >> "$out/ncu-src.log" 2>&1
    done
  done
  exit 0
fi
for mix in ${MIXES:-temperature topk50}; do
  for pad in ${PADS:-256 8}; do
    # warm-up 1 + 3 iterations; skip the first two calls' kernels (module load, warm-up)
    step "${LIMIT:-90}" "$out/ncu-$mix-b$pad.log" \
      ncu --kernel-name regex:'dp_verify_(push|push_nolist|finish)$' --launch-skip 4 \
      --launch-count 2 "${sec_args[@]}" --print-details all \
      $(bench_args "$mix" "$pad")
  done
done
exit 0
