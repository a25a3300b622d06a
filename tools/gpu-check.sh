#!/usr/bin/env bash
# gpu-check: on a machine with an NVIDIA GPU, check the CUDA backend for real.
#
#   tools/gpu-check.sh [OUTDIR]
#       build with --features cuda (BESPOKE_CUDA_ARCH default: native), then run
#       everything below. Needs Rust, nvcc and a driver.
#   tools/gpu-check.sh --package DIR
#       no GPU needed: build the test binaries and `bespoke` for the GPU into
#       DIR, for a GPU machine without Rust (set BESPOKE_CUDA_ARCH, e.g. sm_90a
#       for an H100/H200; one arch keeps the binaries small).
#   tools/gpu-check.sh --prebuilt DIR [OUTDIR]
#       run the binaries a --package made (from the repository root).
#       A package for one arch is about 50 MB stripped (sm_90a, 2026-12):
#       where the copy to the GPU machine is size-limited, `tar cJf` it
#       here and unpack it there. Rehearsed from another root with no
#       /work and no /tmp/pkg-target (the paths the binaries were built
#       with): the tests find the fixtures and `bespoke` as they do here.
#
# What runs, with a GPU required (BESPOKE_REQUIRE_GPU=1), in this order:
#   * tests/gpu.rs: every CUDA-core kernel (4 formats, matvec and matmul,
#     generic and specialised) and every tensor-core path the device's image
#     has, against the CPU reference within their bounds; fp4×q8 on INT8
#     tensor cores bit for bit; attention (decode, causal, DeepSeek V4's row
#     lists); DeepSeek V4's indexer scores bit for bit; SwiGLU blocks whole
#     on the GPU, and `score` with only some experts resident (the same
#     checks also run on the CPU emulator of the CUDA kernels, as they do in
#     CI);
#   * the fixture oracle tests (tests/engine.rs, tests/dsv4.rs) with every
#     matrix in the VRAM tier, attention, DeepSeek V4's indexers and every
#     SwiGLU block on the GPU (BESPOKE_TEST_VRAM): token-exact against
#     transformers;
#   * `bespoke plan` (its CUDA side: the images, the tensor-core paths, the
#     device and what its start-up check found), and `bespoke bench gpu`
#     (GB/s against the card's peak, matrices and attention), both after
#     tests/gpu.rs and before the oracles;
#   * `bench e2e` of the fixtures and of two generated models (the GPU, the
#     GPU block by block, the CPU), then tests/cli.rs.
# It writes OUTDIR/summary.md (default target/gpu-check) and the logs beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
tests=(gpu engine dsv4 cli)

package() {
  local dir=$1
  mkdir -p "$dir"
  export BESPOKE_CUDA_ARCH=${BESPOKE_CUDA_ARCH:-native}
  local json
  json=$(cargo test --release --features cuda --no-run --message-format=json "${tests[@]/#/--test=}" 2>/dev/null) || {
    cargo test --release --features cuda --no-run "${tests[@]/#/--test=}"; exit 1; }
  for t in "${tests[@]}"; do
    exe=$(echo "$json" | grep -o "\"executable\":\"[^\"]*/deps/${t}-[^\"]*\"" | tail -1 | cut -d'"' -f4)
    [ -n "$exe" ] || { echo "gpu-check: no test binary for $t" >&2; exit 1; }
    cp "$exe" "$dir/test-$t"
  done
  cp "${CARGO_TARGET_DIR:-target}/release/bespoke" "$dir/bespoke"
  echo "$root" > "$dir/manifest_dir"
  # Where the test binaries look for `bespoke` (CARGO_BIN_EXE_bespoke, baked in).
  echo "$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/release/bespoke" > "$dir/bin_path"
  # Symbols are not needed to run them: a smaller package travels faster.
  if command -v strip > /dev/null; then strip "$dir"/test-* "$dir/bespoke"; fi
  echo "gpu-check: packaged into $dir ($(du -sh "$dir" | cut -f1)); run tools/gpu-check.sh --prebuilt $dir on the GPU machine"
}

if [ "${1:-}" = "--package" ]; then
  package "${2:?--package DIR}"
  exit 0
fi

prebuilt=""
if [ "${1:-}" = "--prebuilt" ]; then
  prebuilt=${2:?--prebuilt DIR}
  shift 2
fi
out=${1:-target/gpu-check}
mkdir -p "$out"
summary="$out/summary.md"
fail=0

{
  echo "# bespoke gpu-check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi failed"
  echo '```'
} > "$summary"

if [ -n "$prebuilt" ]; then
  # The binaries find the fixtures and `bespoke` where they were built.
  baked=$(cat "$prebuilt/manifest_dir")
  if [ "$baked" != "$root" ] && [ ! -e "$baked" ]; then
    mkdir -p "$(dirname "$baked")" && ln -s "$root" "$baked"
  fi
  mkdir -p target/release
  cp "$prebuilt/bespoke" target/release/bespoke
  binpath=$(cat "$prebuilt/bin_path" 2>/dev/null || echo "$baked/target/release/bespoke")
  if [ ! -e "$binpath" ]; then
    mkdir -p "$(dirname "$binpath")" && cp "$prebuilt/bespoke" "$binpath"
  fi
  bin=target/release/bespoke
  runtest() { "$prebuilt/test-$1" --test-threads=1 --nocapture; }
else
  export BESPOKE_CUDA_ARCH=${BESPOKE_CUDA_ARCH:-native}
  if ! cargo build --release --features cuda > "$out/build.log" 2>&1; then
    echo "build failed: see build.log" >> "$summary"; tail -30 "$out/build.log"; exit 1
  fi
  bin=target/release/bespoke
  runtest() { cargo test --release --features cuda --test "$1" -- --test-threads=1 --nocapture; }
fi

export BESPOKE_REQUIRE_GPU=1 BESPOKE_TEST_VRAM=${BESPOKE_TEST_VRAM:-8}
# The summary grows step by step, most telling first (the kernels against
# the CPU, the plan and the start-up check, the card's GB/s), so a run cut
# short still says the most it can.
tests_of() { # test names
  for t in "$@"; do
    if runtest "$t" > "$out/test-$t.log" 2>&1; then r=passed; else r=FAILED; fail=1; fi
    echo "- $t: $r — $(grep -E '^test result' "$out/test-$t.log" | tail -1)" >> "$summary"
    # (tests/gpu.rs runs its checks on the CPU emulator too: only the GPU's lines here)
    grep -E "worst|bit-identical|bit for bit|ok \(|attention hd|bs_cu_attn_|greedy|SwiGLU blocks|layers run whole|RMSNorm|turned away|start-up check" "$out/test-$t.log" | grep -v "emulator" | sed 's/^/    /' >> "$summary"
  done
}
echo -e "\n## Tests (GPU required)\n" >> "$summary"
tests_of gpu

echo -e "\n## bespoke plan (CUDA side)\n\n\`\`\`" >> "$summary"
$bin plan 2>&1 | sed -n '/^CUDA build/,$p' >> "$summary"
echo '```' >> "$summary"

echo -e "\n## bespoke bench gpu\n\n\`\`\`" >> "$summary"
if ! $bin bench gpu --json "$out/bench-gpu.json" >> "$summary" 2> "$out/bench-gpu.err"; then
  fail=1; tail -5 "$out/bench-gpu.err" >> "$summary"
fi
echo '```' >> "$summary"

echo -e "\n## Tests: fixture oracles with the weights in VRAM\n" >> "$summary"
tests_of engine dsv4

# A whole model, weights and attention in VRAM against the CPU: on a fixture
# this small the time is the launches' and the waits', which the SwiGLU
# blocks (one wait each, the MoE layer's experts queued together) and, for
# the dense tiny-llama, the forwards with every layer on the GPU (one wait a
# step; "blocks" is the same build with BESPOKE_CUDA_LAYERS=off) cut.
e2e() { # model, mode, extra bench flags
  local m=$1 mode=$2 log="$out/e2e-$(basename "$1")-$2.log"; shift 2
  echo "$m, $mode:" >> "$summary"
  case $mode in
    gpu) $bin bench e2e --model "$m" --vram 8 "$@" > "$log" 2>&1 || fail=1 ;;
    blocks) BESPOKE_CUDA_LAYERS=off $bin bench e2e --model "$m" --vram 8 "$@" > "$log" 2>&1 || fail=1 ;;
    # --bf16-act bf16: prefill on the BF16 tensor cores, every layer still on
    # the GPU (the host CPU must run the variant too: AVX512_BF16).
    bf16act)
      if ! $bin bench e2e --model "$m" --vram 8 --bf16-act bf16 "$@" > "$log" 2>&1; then
        grep -q "needs the bf16dot kernels" "$log" && echo "(not run: this CPU has no AVX512_BF16)" >> "$summary" || fail=1
      fi ;;
    cpu) BESPOKE_CUDA=off $bin bench e2e --model "$m" "$@" > "$log" 2>&1 || fail=1 ;;
  esac
  grep -E "^threads|VRAM tier|failed|ran on the GPU|tensor-core path" "$log" >> "$summary"
}
echo -e "\n## bespoke bench e2e: fixtures, --vram 8, then the CPU\n\n\`\`\`" >> "$summary"
for m in tiny-dsv4 tiny-qwen3-moe tiny-llama; do
  modes="gpu cpu"; [ $m = tiny-llama ] && modes="gpu blocks cpu"
  for mode in $modes; do e2e "fixtures/$m" $mode --quick; done
done
echo '```' >> "$summary"

# A dense model large enough for the GPU's bandwidth to count (0.92 GiB of
# BF16, tools/make_bench_model.py; needs numpy): whole forwards on the GPU
# (f32 activations on the CUDA cores, then --bf16-act bf16 with prefill on
# the tensor cores), block by block, and the CPU.
bench_llama=${BESPOKE_BENCH_LLAMA:-/tmp/bespoke-bench-llama}
if [ -f "$bench_llama/model.safetensors" ] || python3 tools/make_bench_model.py --out "$bench_llama" > "$out/make-bench.log" 2>&1; then
  echo -e "\n## bespoke bench e2e: the bench Llama ($bench_llama), --vram 8, then the CPU\n\n\`\`\`" >> "$summary"
  for mode in gpu bf16act blocks cpu; do e2e "$bench_llama" $mode --prompt-len 128 --gen 32; done
  echo '```' >> "$summary"
else
  echo -e "\n(no bench Llama: $(tail -1 "$out/make-bench.log"))" >> "$summary"
fi

# And a Qwen3-MoE of 1.4 GiB (4 layers of 32 experts, 4 chosen a token):
# every expert resident, about half of them (the rest on the CPU, with every
# layer still on the GPU), block by block, and the CPU.
bench_moe=${BESPOKE_BENCH_MOE:-/tmp/bespoke-bench-moe}
if [ -f "$bench_moe/model.safetensors" ] || python3 tools/make_bench_model.py --out "$bench_moe" \
    --layers 4 --experts 32 --top-k 4 --moe-intermediate 768 > "$out/make-bench-moe.log" 2>&1; then
  echo -e "\n## bespoke bench e2e: the bench Qwen3-MoE ($bench_moe)\n\n\`\`\`" >> "$summary"
  e2e "$bench_moe" gpu --prompt-len 128 --gen 32
  echo "(--vram 0.8: part of the experts)" >> "$summary"
  $bin bench e2e --model "$bench_moe" --vram 0.8 --prompt-len 128 --gen 32 > "$out/e2e-moe-part.log" 2>&1 || fail=1
  grep -E "^threads|VRAM tier|failed|ran on the GPU|tensor-core path" "$out/e2e-moe-part.log" >> "$summary"
  for mode in blocks cpu; do e2e "$bench_moe" $mode --prompt-len 128 --gen 32; done
  echo '```' >> "$summary"
else
  echo -e "\n(no bench Qwen3-MoE: $(tail -1 "$out/make-bench-moe.log"))" >> "$summary"
fi
echo -e "\n## Tests: the CLI\n" >> "$summary"
tests_of cli
cat "$summary"
exit $fail
