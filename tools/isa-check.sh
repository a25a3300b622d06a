#!/usr/bin/env bash
# Run the kernel variants this machine cannot execute natively against the
# scalar variant, bit for bit, on the sources this build generated:
#   avx512 — compiled against SIMDe's portable AVX-512 (libsimde-dev), when the
#            CPU lacks AVX-512 (with AVX-512 the Rust conformance tests run it);
#   neon   — cross-compiled with aarch64-linux-gnu-gcc and run under qemu-aarch64
#            (apt-get install gcc-aarch64-linux-gnu qemu-user).
# Usage: tools/isa-check.sh [avx512] [neon]   (default: both, where the tools exist)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
# The build directory this build wrote last (by its newest source: a directory's own mtime
# only changes when files are added, and cargo keeps one per feature set).
out=$(dirname "$(ls -t target/release/build/bespoke-*/out/kernels/*.c | head -1)")
want=("$@")
[ ${#want[@]} -gt 0 ] || want=(avx512 neon)
flags=(-O3 -std=c11 -ffp-contract=off -fno-fast-math -Wall -Wextra -Ikernels -I"$out" -Itools/isa-check)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
for isa in "${want[@]}"; do
  case "$isa" in
    avx512)
      if [ ! -f /usr/include/simde/x86/avx512.h ]; then
        echo "isa-check: avx512: SIMDe missing (apt-get install libsimde-dev)"; status=1; continue
      fi
      # bf16dot and fp8dot too, their instruction emulated as its definition
      # (see templates/bf16dot.c.tera).
      cc "${flags[@]}" -mavx2 -mfma -mf16c -Wno-psabi -DBS_EMULATE_AVX512 -DISA=avx512 -DBF16DOT \
        tools/isa-check/driver.c "$out"/mat_*_avx512.c "$out"/attn_avx512.c "$out"/q8_fp4_avx512.c \
        "$out"/bf16dot_avx512.c "$out"/fp8dot_avx512.c \
        "$out"/mat_*_scalar.c "$out"/attn_scalar.c "$out"/q8_fp4_scalar.c \
        -lm -o "$tmp/avx512"
      "$tmp/avx512" || status=1
      ;;
    neon)
      if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
        echo "isa-check: neon: needs aarch64-linux-gnu-gcc and qemu-aarch64"; status=1; continue
      fi
      aarch64-linux-gnu-gcc "${flags[@]}" -static -DISA=neon \
        tools/isa-check/driver.c "$out"/mat_*_neon.c "$out"/attn_neon.c "$out"/q8_fp4_neon.c \
        "$out"/mat_*_scalar.c "$out"/attn_scalar.c "$out"/q8_fp4_scalar.c \
        -lm -o "$tmp/neon"
      qemu-aarch64 "$tmp/neon" || status=1
      ;;
    *) echo "isa-check: unknown variant $isa (avx512, neon)"; status=1 ;;
  esac
done
exit $status
