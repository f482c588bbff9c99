#!/usr/bin/env bash
# Exports for this folder's next-call-*.sh (run here, from the repository root, before the
# device call; carry the three trees and the script copied to .devrun*.sh):
#   .devtree_m   main (HEAD)
#   .devtree_f   main plus this folder's patches, in order
#   .devtree_f1  .devtree_f with DV_DRAIN_ROUNDS 1 (patch 0003's drains every two-warp
#                round again: what the series gains without it)
#   .devtree_pN  main plus the first N patches, for each N in PARTS (e.g. PARTS="2 5": to
#                find which patch costs, should F be slower than M)
# Each export's commit (and what was applied) is in its COMMIT; benchmarks/ is left out.
set -eu
cd "$(git rev-parse --show-toplevel)"
dir=benchmarks/prepared-2026-12-07i
rm -rf .devtree_m .devtree_f .devtree_f1 .devtree_p[0-9]*
mkdir .devtree_m
git archive HEAD | tar -x -C .devtree_m
git rev-parse --short HEAD > .devtree_m/COMMIT
rm -rf .devtree_m/benchmarks
cp -r .devtree_m .devtree_f
n=0
for p in "$dir"/0*.patch; do
  patch -s -p1 -d .devtree_f < "$p"
  n=$((n + 1))
done
echo "$(cat .devtree_m/COMMIT)+${n}patches" > .devtree_f/COMMIT
cp -r .devtree_f .devtree_f1
sed -i 's/^#define DV_DRAIN_ROUNDS 2$/#define DV_DRAIN_ROUNDS 1/' .devtree_f1/kernels/verify.cuh
grep -q '^#define DV_DRAIN_ROUNDS 1$' .devtree_f1/kernels/verify.cuh
echo "$(cat .devtree_f/COMMIT)+drain1" > .devtree_f1/COMMIT
for part in ${PARTS:-}; do
  rm -rf ".devtree_p$part"
  cp -r .devtree_m ".devtree_p$part"
  n=0
  for p in "$dir"/0*.patch; do
    [ "$n" -lt "$part" ] || break
    patch -s -p1 -d ".devtree_p$part" < "$p"
    n=$((n + 1))
  done
  echo "$(cat .devtree_m/COMMIT)+${n}patches" > ".devtree_p$part/COMMIT"
done
head -n1 .devtree_*/COMMIT
