#!/usr/bin/env bash
# FlashAttention-4 on a lent GPU machine that installs only what a device call carries (64 MiB, the working tree's
# ~16 MiB included), as ../shared/recipes/fa4-on-the-device.md describes, in three parts that each fit beside the tree:
#   bash bench/fa4_wheels.sh fetch        here: cp312 manylinux wheels into .wheels/ (git-ignored), as .wheels/a, b, c
#   bash bench/fa4_wheels.sh keep a       device call 1, carrying .wheels/a: keep the part in $S (default /tmp/fa4)
#   bash bench/fa4_wheels.sh keep b       device call 2, carrying .wheels/b
#   bash bench/fa4_wheels.sh unpack       device call 3, carrying .wheels/c: join and unpack into $S/site (once)
# then, in that call or later ones on the same machine:
#   PYTHONPATH=$S/site:$S/site/nvidia_cutlass_dsl/dsl_packages NPROC=2 bash bench/gpu_e2e.sh ... --attention-backend fa4
# A machine is given back 30 s after its last call ends (and with it $S): make the calls back to back.
set -euo pipefail
S=${S:-/tmp/fa4}
BIG=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl  # 92 MB: split over parts a and b
case "${1:-}" in
  fetch)
    rm -rf .wheels/all .wheels/a .wheels/b .wheels/c
    mkdir -p .wheels/all .wheels/a .wheels/b .wheels/c
    pip download --no-deps -q --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
      -d .wheels/all flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
      "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext einops protobuf
    split -b 46M ".wheels/all/$BIG" .wheels/a/part_
    mv .wheels/a/part_ab .wheels/b/
    rm ".wheels/all/$BIG" && mv .wheels/all/*.whl .wheels/c/ && rmdir .wheels/all
    du -sh .wheels/a .wheels/b .wheels/c ;;
  keep)
    part=${2:?which part: a or b}
    mkdir -p "$S" && cp .wheels/"$part"/part_* "$S"/ && ls -l "$S" ;;
  unpack)
    if [ ! -d "$S/site/flash_attn" ]; then
      [ -f "$S/part_aa" ] && [ -f "$S/part_ab" ] || { echo "$S lacks part_aa or part_ab: run keep a and keep b first"; exit 2; }
      cp .wheels/c/*.whl "$S"/ && cat "$S/part_aa" "$S/part_ab" > "$S/$BIG" && rm "$S"/part_a?
      # (python -m zipfile, not pip --target, which would not merge the wheels' shared namespace folders; cuda/ is
      # the image's own cuda.bindings)
      for wheel in "$S"/*.whl; do python3 -m zipfile -e "$wheel" "$S/site/"; done
      rm -rf "$S/site/cuda"
    fi
    echo "FA4 unpacked: PYTHONPATH=$S/site:$S/site/nvidia_cutlass_dsl/dsl_packages" ;;
  *)
    sed -n '2,10p' "$0"; exit 2 ;;
esac
