#!/usr/bin/env bash
# compare-llamacpp.sh: bespoke vs llama.cpp on this machine, as one ratio table. Not run in CI.
#
#   tools/compare-llamacpp.sh [--model DIR] [--threads N] [--prompt-len P] [--gen N] [--rounds R] [--cache DIR]
#
#   --model DIR     HF checkpoint, BF16 safetensors (default /tmp/bespoke-bench-llama: tools/make_bench_model.py)
#   --threads N     threads for the "all threads" runs (default: physical cores)
#   --prompt-len P  prompt tokens (default 128)          --gen N   generated tokens (default 32)
#   --rounds R      whole-model rounds (default 3): llama-bench and bespoke take turns R times, so that
#                   a shared machine's drift falls on both; each row gives the median of the R
#                   per-round ratios and their range
#   --cache DIR     build, GGUFs, logs, results (default ${BESPOKE_CACHE:-~/.cache/bespoke}/llama.cpp)
# Environment: BESPOKE_BIN (default: a build specialised for the model, BESPOKE_MODEL=DIR plus DeepSeek V4
# Flash's shapes, in $cache/bespoke-target), PYTHON (has torch, numpy, transformers, for llama.cpp's GGUF
# converter; default python3), LLAMACPP_SDIST (llama-cpp-python sdist on disk).
#
# Builds llama.cpp once (vendor/llama.cpp of the llama-cpp-python sdist from PyPI; cmake from PyPI),
# converts the model with its convert_hf_to_gguf.py (BF16, cached), then times llama-bench against
# `bespoke bench e2e` and test-backend-ops perf against `bespoke bench kernels`. The table of
# bespoke / llama.cpp ratios is also saved to $cache/compare-<date>.txt.
set -euo pipefail

die() { echo "compare-llamacpp: error: $*" >&2; exit 1; }
say() { echo "compare-llamacpp: $*" >&2; }
usage() { sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEFAULT_MODEL=/tmp/bespoke-bench-llama            # tools/make_bench_model.py's --out default
MODEL=$DEFAULT_MODEL
THREADS=$(lscpu -p=socket,core 2>/dev/null | grep -v '^#' | sort -u | wc -l)
PROMPT=128 GEN=32 ROUNDS=3
CACHE=${BESPOKE_CACHE:-$HOME/.cache/bespoke}/llama.cpp
PYTHON=${PYTHON:-python3}

while [[ $# -gt 0 ]]; do
  case $1 in
    --model) MODEL=${2:?--model needs a directory}; shift 2 ;;
    --threads) THREADS=${2:?--threads needs a number}; shift 2 ;;
    --prompt-len) PROMPT=${2:?--prompt-len needs a number}; shift 2 ;;
    --gen) GEN=${2:?--gen needs a number}; shift 2 ;;
    --rounds) ROUNDS=${2:?--rounds needs a number}; shift 2 ;;
    --cache) CACHE=${2:?--cache needs a directory}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
[[ $THREADS =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer (got '$THREADS')"
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive integer (got '$ROUNDS')"

# ---- prerequisites -------------------------------------------------------------------------
for t in python3 tar lscpu make c++; do command -v $t >/dev/null || die "'$t' not found (needed here)"; done
if [[ ! -f $MODEL/config.json ]]; then
  [[ $MODEL == "$DEFAULT_MODEL" ]] && die "default model $MODEL not found; make it (~1 GB, needs numpy) with:
    python3 $REPO/tools/make_bench_model.py --out $MODEL"
  die "--model $MODEL: no config.json there"
fi
MODEL=$(cd "$MODEL" && pwd)
ls "$MODEL"/*.safetensors >/dev/null 2>&1 || die "--model $MODEL: no *.safetensors files"

mkdir -p "$CACHE" && CACHE=$(cd "$CACHE" && pwd)
if [[ -z ${BESPOKE_BIN:-} ]]; then
  # What bespoke is for: a build specialised for this model (every matrix on a kernel with its
  # shape baked in), plus DeepSeek V4 Flash's shapes for the kernel rows; its own target
  # directory, so that the repository's default build is left alone.
  command -v cargo >/dev/null || die "cargo not found; install Rust or set BESPOKE_BIN=/path/to/bespoke"
  SPEC="$MODEL,fixtures/configs/deepseek-v4-flash.json,fixtures/configs/deepseek-v4-flash-bf16.json"
  say "building bespoke specialised for $MODEL (BESPOKE_MODEL=$SPEC cargo build --release" \
      "--target-dir $CACHE/bespoke-target)"
  (cd "$REPO" && BESPOKE_MODEL=$SPEC cargo build --release --quiet --target-dir "$CACHE/bespoke-target") ||
    die "cargo build --release (BESPOKE_MODEL=$SPEC) failed"
  BESPOKE_BIN=$CACHE/bespoke-target/release/bespoke
fi
[[ -x $BESPOKE_BIN ]] || die "BESPOKE_BIN=$BESPOKE_BIN is not an executable"
SRC=$CACHE/src/llama.cpp BUILD=$CACHE/build STAMP=$(date +%Y-%m-%d-%H%M%S)
RUN=$CACHE/runs/$STAMP && mkdir -p "$RUN"
# logged NAME CMD...: run CMD, output in $RUN/NAME.log (stdout in $STDOUT if set); on failure show the tail, stop.
logged() {
  local log=$RUN/$1.log; shift; : >"$log"
  "$@" >>"${STDOUT:-$log}" 2>>"$log" || { tail -n 25 "$log" >&2; die "${log##*/} failed (log: $log)"; }
}

# ---- 1. llama.cpp, built once into the cache ------------------------------------------------
if [[ ! -f $SRC/CMakeLists.txt ]]; then
  SDIST=${LLAMACPP_SDIST:-$CACHE/llama-cpp-python.tar.gz}
  [[ -n ${LLAMACPP_SDIST:-} && ! -f $SDIST ]] && die "LLAMACPP_SDIST=$SDIST does not exist"
  if [[ ! -f $SDIST ]]; then
    say "downloading the llama-cpp-python sdist from PyPI (~76 MB)"
    python3 - "$SDIST" <<'EOF' || die "could not download llama-cpp-python's sdist from PyPI (set LLAMACPP_SDIST)"
import hashlib, json, sys, urllib.parse, urllib.request
api = "https://pypi.org/pypi/llama-cpp-python/json"
sdist = [u for u in json.load(urllib.request.urlopen(api, timeout=60))["urls"] if u["packagetype"] == "sdist"][0]
url = urllib.parse.urljoin(api, sdist["url"])          # the url may be relative (../../packages/...)
data = urllib.request.urlopen(url, timeout=600).read()
if hashlib.sha256(data).hexdigest() != sdist["digests"]["sha256"]: sys.exit("sha256 mismatch: " + url)
open(sys.argv[1], "wb").write(data)
EOF
  fi
  say "extracting vendor/llama.cpp from $SDIST"
  tmp=$(mktemp -d "$CACHE/extract.XXXXXX")
  tar -xzf "$SDIST" -C "$tmp" --wildcards '*/vendor/llama.cpp/*' '*/PKG-INFO' || die "$SDIST: no vendor/llama.cpp"
  top=$(find "$tmp" -mindepth 1 -maxdepth 1 -type d | head -n 1)
  # The sdist keeps the submodule's git metadata: its HEAD is the llama.cpp commit.
  commit=$(head -c 40 "$top/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null || echo unknown)
  pyver=$(sed -n 's/^Version: //p' "$top/PKG-INFO" | head -n 1)
  echo "${commit:0:7} llama-cpp-python $pyver" >"$CACHE/version"
  mkdir -p "$CACHE/src" && rm -rf "$SRC" && mv "$top/vendor/llama.cpp" "$SRC" && rm -rf "$tmp"
  rm -f "$SRC/.git"                                  # a gitfile pointing outside the tree
fi
LLAMA_BENCH=$BUILD/bin/llama-bench TBO=$BUILD/bin/test-backend-ops
if [[ ! -x $LLAMA_BENCH || ! -x $TBO ]]; then
  if [[ ! -x $CACHE/venv/bin/cmake ]]; then
    say "installing cmake from PyPI into $CACHE/venv"
    python3 -m venv "$CACHE/venv" || die "python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
    logged pip-cmake "$CACHE/venv/bin/pip" install cmake
  fi
  commit=$(cut -d' ' -f1 "$CACHE/version")
  say "building llama.cpp $commit: llama-bench, test-backend-ops (several minutes; logs in $RUN)"
  logged cmake-configure "$CACHE/venv/bin/cmake" -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMIT="$commit"
  logged cmake-build "$CACHE/venv/bin/cmake" --build "$BUILD" --config Release -j"$(nproc)" \
    --target llama-bench test-backend-ops
fi
VERSION="$("$LLAMA_BENCH" --version 2>&1 | sed -n 's/^version: //p')"
VERSION+=", from the $(cut -d' ' -f2- "$CACHE/version") sdist"

# ---- 2. the model as a BF16 GGUF, converted by llama.cpp's own converter (cached) -----------
NAME=$(basename "$MODEL")
GGUF=$CACHE/models/$NAME-bf16.gguf
NEWER=$([[ ! -f $GGUF ]] ||   # the checkpoint changed since the conversion
  find "$MODEL" -maxdepth 1 -newer "$GGUF" \( -name '*.safetensors' -o -name config.json \))
if [[ ! -f $GGUF || -n $NEWER ]]; then
  "$PYTHON" -c 'import torch, numpy, transformers' 2>/dev/null ||
    die "PYTHON=$PYTHON cannot import torch, numpy, transformers (convert_hf_to_gguf.py needs them): set PYTHON"
  # Small converter dependencies missing from $PYTHON go to $CACHE/pydeps, not into its environment.
  PYPATH=$SRC/gguf-py:$CACHE/pydeps${PYTHONPATH:+:$PYTHONPATH}
  for dep in sentencepiece:sentencepiece yaml:pyyaml tqdm:tqdm; do
    PYTHONPATH=$PYPATH "$PYTHON" -c "import ${dep%%:*}" 2>/dev/null ||
      logged "pip-${dep#*:}" "$PYTHON" -m pip install --target "$CACHE/pydeps" "${dep#*:}"
  done
  # Convert from a staging directory of links; a model without a tokenizer (the bench model)
  # gets a synthetic Llama-style one there, sized to vocab_size (llama-bench feeds random ids).
  HF=$CACHE/models/$NAME.hf
  rm -rf "$HF" && mkdir -p "$HF" && ln -s "$MODEL"/* "$HF"/
  if [[ ! -e $HF/tokenizer.json && ! -e $HF/tokenizer.model ]]; then
    say "$MODEL has no tokenizer: writing a synthetic one for the conversion"
    python3 - "$HF" <<'EOF'
import json, os, sys
d, sp = sys.argv[1], "\u2581"
n = json.load(open(os.path.join(d, "config.json")))["vocab_size"]
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
vocab.update({f"{sp}t{i}": i for i in range(len(vocab), n)})    # byte-fallback BPE, no merges
special = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True} for t, i in list(vocab.items())[:3]]
json.dump({"version": "1.0", "added_tokens": special, "normalizer": {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": sp}, {"type": "Replace", "pattern": {"String": " "}, "content": sp}]},
    "pre_tokenizer": None, "post_processor": None, "decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": sp}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
              "vocab": vocab, "merges": []}}, open(os.path.join(d, "tokenizer.json"), "w"))
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>"}, open(os.path.join(d, "tokenizer_config.json"), "w"))
EOF
  fi
  say "converting $MODEL to $GGUF (BF16)"
  PYTHONPATH=$PYPATH logged convert "$PYTHON" "$SRC/convert_hf_to_gguf.py" "$HF" --outtype bf16 \
    --outfile "$GGUF.part"
  mv "$GGUF.part" "$GGUF"
fi

# ---- 3. whole model: llama-bench vs bespoke bench e2e ---------------------------------------
TLIST=1; [[ $THREADS -gt 1 ]] && TLIST=1,$THREADS
LOAD=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo unknown)   # other work on the machine skews everything
# llama.cpp multiplies BF16 weights by activations rounded to BF16; bespoke's variant that does the
# same (--bf16-act bf16, the bf16dot kernels) runs too where the CPU has AVX512_BF16.
BF16DOT=$("$BESPOKE_BIN" plan 2>/dev/null | grep '^bf16dot ' || true)   # "…, runnable" or "…, not runnable: why"
BD_NOTE=" (and again with --bf16-act bf16)"
[[ $BF16DOT == *", runnable" ]] || { BD_NOTE=""; say "no bf16dot rows: ${BF16DOT:-this bespoke has no bf16dot kernels}"; }
# And on AMX tiles (--bf16-act amx: prefill of BF16 weights by TDPBF16PS, decode by the f32 kernels)
# where the CPU has AMX-BF16 (Intel Sapphire Rapids and later).
AMX=$("$BESPOKE_BIN" plan 2>/dev/null | grep '^amx ' || true)
[[ $AMX == *", runnable" ]] && BD_NOTE="$BD_NOTE (and with --bf16-act amx)" ||
  say "no amx rows: ${AMX:-this bespoke has no amx kernels}"
# The two sides take turns, round after round: with one run of each, minutes apart, a shared
# machine's drift (its read bandwidth moved by 2x within an hour on the VMs measured) lands on one
# side alone.
# bespoke's decode runs after its prompt, at context PROMPT..PROMPT+GEN; llama-bench's tg test starts
# from an empty context unless given a depth (-d), so where it has -d its decode runs at the same
# depth, as a test of its own (-d on the pp test would prefill at that depth too).
# (its help read whole first: grep -q stopping early would fail the pipe under pipefail)
DEPTH=(); LB_HELP=$("$LLAMA_BENCH" --help 2>&1 || true)
[[ $LB_HELP == *--n-depth* ]] && DEPTH=(-d "$PROMPT")
[[ ${#DEPTH[@]} -gt 0 ]] || say "this llama-bench has no -d: its decode starts from an empty context"
# Both sides stream their weights from memory-mapped files, and how the page cache holds a file
# matters: one just written (a fresh GGUF, a checkpoint just made or downloaded) sits in 4 KiB pages,
# one read back from disk mostly in 2 MiB folios, mapped with 2 MiB pages on recent kernels (Linux
# 6.18, ext4: 0 % and 96 % of the bench model). A streaming BF16 kernel ran 6-10 % faster over 2 MiB
# pages than 4 KiB ones in a C harness on a Zen 4 core, at 1 thread. So both files leave the page
# cache first (POSIX_FADV_DONTNEED; pages another process maps stay) and are read back from disk by
# the first round alike.
python3 - "$GGUF" "$MODEL"/*.safetensors <<'EOF' || say "could not drop the model files from the page cache"
import os, sys
for f in sys.argv[1:]:
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)    # written pages must reach the disk before they can be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
EOF
for ((i = 1; i <= ROUNDS; i++)); do
  say "round $i/$ROUNDS: llama-bench -p $PROMPT -n 0, -p 0 -n $GEN ${DEPTH[*]} -t $TLIST;" \
      "bespoke bench e2e --prompt-len $PROMPT --gen $GEN --threads $THREADS$BD_NOTE"
  STDOUT=$RUN/llama-bench-pp-$i.json logged llama-bench-pp-$i "$LLAMA_BENCH" -m "$GGUF" -p "$PROMPT" \
    -n 0 -t "$TLIST" -o json
  STDOUT=$RUN/llama-bench-tg-$i.json logged llama-bench-tg-$i "$LLAMA_BENCH" -m "$GGUF" -p 0 -n "$GEN" \
    "${DEPTH[@]}" -t "$TLIST" -o json
  python3 -c 'import json, sys; json.dump(sum((json.load(open(f)) for f in sys.argv[2:]), []), open(sys.argv[1], "w"))' \
    "$RUN/llama-bench-$i.json" "$RUN/llama-bench-pp-$i.json" "$RUN/llama-bench-tg-$i.json"
  logged bespoke-e2e-$i "$BESPOKE_BIN" bench e2e --model "$MODEL" --prompt-len "$PROMPT" --gen "$GEN" \
    --threads "$THREADS" --json "$RUN/bespoke-e2e-$i.json"
  if [[ $BF16DOT == *", runnable" ]]; then
    logged bespoke-e2e-bf16dot-$i "$BESPOKE_BIN" bench e2e --model "$MODEL" --prompt-len "$PROMPT" \
      --gen "$GEN" --threads "$THREADS" --bf16-act bf16 --json "$RUN/bespoke-e2e-bf16dot-$i.json"
  fi
  if [[ $AMX == *", runnable" ]]; then
    logged bespoke-e2e-amx-$i "$BESPOKE_BIN" bench e2e --model "$MODEL" --prompt-len "$PROMPT" \
      --gen "$GEN" --threads "$THREADS" --bf16-act amx --json "$RUN/bespoke-e2e-amx-$i.json"
  fi
done

# ---- 4. kernels: test-backend-ops perf vs bespoke bench kernels ------------------------------
# test-backend-ops runs the CPU backend at hardware_concurrency/2 threads (fixed); bespoke's kernels too.
KT=$(( $(nproc) / 2 )); [[ $KT -ge 1 ]] || KT=1
say "bespoke bench kernels: --formats bf16,fp4,fp4q8,bf16dot --threads $KT"
logged bespoke-kernels "$BESPOKE_BIN" bench kernels --formats bf16,fp4,fp4q8,bf16dot --threads "$KT" \
  --json "$RUN/bespoke-kernels.json"
# llama.cpp's own matvec perf cases (n=1) for BF16 and MXFP4: other shapes than bespoke's.
say "test-backend-ops perf: built-in MUL_MAT cases, bf16 and mxfp4, n=1"
logged tbo-builtin "$TBO" perf -b CPU -o MUL_MAT --output sql \
  -p 'type_a=(bf16|mxfp4),type_b=f32,m=[0-9]+,n=1,k=[0-9]+,bs=\[1,1\]'
# The same shapes as bespoke's, through --test-file (one MUL_MAT per line: op, type, ne, params, srcs).
python3 - "$RUN/bespoke-kernels.json" "$SRC/ggml/include/ggml.h" >"$RUN/shapes.txt" <<'EOF'
import json, re, sys
h = open(sys.argv[2]).read()
ops = re.findall(r"\b(GGML_OP_\w+)", h[h.index("enum ggml_op {"):].split("};")[0])
types = {k: int(v) for k, v in re.findall(r"GGML_TYPE_(\w+)\s*=\s*(\d+)", h)}
blk = {"BF16": (1, 2), "MXFP4": (32, 17)}  # (block size, bytes per block)
cases = {({"bf16": "BF16", "fp4": "MXFP4"}.get(c["format"]), c["rows"], c["cols"])
         for c in json.load(open(sys.argv[1]))["kernels"]}
for t, m, k in sorted(c for c in cases if c[0] and c[1] * c[2] >= 1 << 20 and c[2] % blk[c[0]][0] == 0):
    row = k // blk[t][0] * blk[t][1]
    print(ops.index("GGML_OP_MUL_MAT"), types["F32"], m, 1, 1, 1, 0, 2,
          types[t], k, m, 1, 1, blk[t][1], row, row * m, row * m,
          types["F32"], k, 1, 1, 1, 4, 4 * k, 4 * k, 4 * k, f"{t.lower()}_{m}x{k}")
EOF
say "test-backend-ops perf: bespoke's shapes ($(wc -l <"$RUN/shapes.txt") cases)"
logged tbo-shapes "$TBO" perf -b CPU --output sql --test-file "$RUN/shapes.txt"

# ---- 5. the ratio table -----------------------------------------------------------------------
CPU=$(lscpu | sed -n 's/^Model name: *//p' | head -n 1) TXT=$CACHE/compare-$STAMP.txt
python3 - "$RUN" "$KT" "$THREADS" "$VERSION" "$CPU" "$("$BESPOKE_BIN" --version)" "$LOAD" "$ROUNDS" \
  <<'EOF' | tee "$TXT"
import json, os, re, statistics, sys
run, kt, threads, version, cpu, bver, load, rounds = sys.argv[1], int(sys.argv[2]), *sys.argv[3:8], int(sys.argv[8])
def load_json(name):
    return json.load(open(f"{run}/{name}")) if os.path.exists(f"{run}/{name}") else None
e2e = [load_json(f"bespoke-e2e-{i}.json") for i in range(1, rounds + 1)]
e2e_bd = [load_json(f"bespoke-e2e-bf16dot-{i}.json") for i in range(1, rounds + 1)]
e2e_amx = [load_json(f"bespoke-e2e-amx-{i}.json") for i in range(1, rounds + 1)]
lb = [load_json(f"llama-bench-{i}.json") for i in range(1, rounds + 1)]
bk = json.load(open(f"{run}/bespoke-kernels.json"))["kernels"]
rows = []          # (label, bespoke, llama.cpp, range of the per-round ratios or None)
for tag, sides in (("", e2e), (", bf16dot", e2e_bd if e2e_bd[0] else []),
                   (", amx", e2e_amx if e2e_amx[0] else [])):
    for t in sorted({r["threads"] for r in sides[0]["runs"]} if sides else []):
        for what, p in (("prefill", True), ("decode", False)):
            b, l, noisy = [], [], ""
            for side, bench in zip(sides, lb):   # round by round
                x = next((x for x in bench
                          if (x["n_threads"], bool(x["n_prompt"]), bool(x["n_gen"])) == (t, p, not p)), None)
                r = next(r for r in side["runs"] if r["threads"] == t)
                if x:
                    b.append(r[f"{what}_tok_s"])
                    l.append(x["avg_ts"])
                    noisy = noisy or (" !" if x["stddev_ts"] > 0.1 * x["avg_ts"] else "")  # repeats spread > 10%
            ratios = [u / v for u, v in zip(b, l) if u and v]
            rows.append((f"{what} tok/s, {t} thread(s){tag}{noisy}", statistics.median(b) if b else None,
                         statistics.median(l) if l else None,
                         (statistics.median(ratios), min(ratios), max(ratios)) if ratios else None))
def perf(name):  # test-backend-ops --output sql -> (type, m, k, weight GB/s) per case
    for line in open(f"{run}/{name}.log"):
        s = re.match(r"INSERT INTO \w+ \((.*?)\) VALUES \('(.*)'\);$", line.strip())
        rec = dict(zip(s.group(1).split(", "), s.group(2).split("', '"))) if s else {}
        p = re.search(r"name=(\w+?)_(\d+)x(\d+)|type_a=(\w+),type_b=f32,m=(\d+),n=1,k=(\d+)",
                      rec.get("op_params", ""))
        if rec.get("supported") == "1" and p and float(rec["time_us"]) > 0:
            t, m, k = [g for g in p.groups() if g]
            yield t, int(m), int(k), int(m) * int(k) * (2 if t == "bf16" else 17 / 32) / float(rec["time_us"]) / 1e3
def bespoke(fmt, res, shape=None):  # best ISA, specialised kernel where the build has one
    c = [x for x in bk if x["format"] == fmt and x["threads"] == kt and x["residency"] == res
         and (shape is None or (x["rows"], x["cols"]) == shape)]
    c = [x for x in c if x["kernel"] == "specialised"] or c
    return max(c, key=lambda x: x["gb_per_s"], default=None)
names = {"bf16": ("bf16", "BF16"), "mxfp4": ("fp4", "FP4 vs MXFP4")}
for t, m, k, gb in perf("tbo-shapes"):                     # same shape, weights cache-resident
    b = bespoke(names[t][0], "cache", (m, k))
    rows.append((f"{names[t][1]} matvec GB/s {m}x{k}, {kt}t", b and b["gb_per_s"], gb, None))
    if t == "mxfp4":  # bespoke's int8-activation variant, like llama.cpp's q8_0 activations
        b = bespoke("fp4q8", "cache", (m, k))
        rows.append((f"FP4xq8 vs MXFP4 matvec GB/s {m}x{k}, {kt}t", b and b["gb_per_s"], gb, None))
    if t == "bf16":   # bespoke's BF16-activation variant, like llama.cpp's bf16 activations
        b = bespoke("bf16dot", "cache", (m, k))
        if b:
            rows.append((f"BF16dot vs BF16 matvec GB/s {m}x{k}, {kt}t", b["gb_per_s"], gb, None))
for t, m, k, gb in perf("tbo-builtin"):                    # other shapes: GB/s per type
    b = bespoke(names[t][0], "stream")
    label = f"{names[t][1]} GB/s {b['rows']}x{b['cols']} vs {m}x{k}*, {kt}t" if b else f"{t} {m}x{k}*"
    rows.append((label, b and b["gb_per_s"], gb, None))
    b = bespoke("bf16dot", "stream") if t == "bf16" else None
    if b:
        rows.append((f"BF16dot GB/s {b['rows']}x{b['cols']} vs {m}x{k}*, {kt}t", b["gb_per_s"], gb, None))

f = lambda v: f"{v:10.2f}" if v else "         -"
print(f"machine:   {cpu}, {threads} threads for the e2e runs, {kt} for the kernels; load average {load} at start")
print(f"llama.cpp: {version}, BF16 GGUF")
print(f"bespoke:   {bver}, {e2e[0]['kernels']} kernels, "
      f"{e2e[0]['specialised_matrices'][0]} of {e2e[0]['specialised_matrices'][1]} matrices on specialised kernels")
depth = max((x.get("n_depth", 0) for x in lb[0] if x["n_gen"]), default=0)
print(f"model:     {e2e[0]['model']}, prompt {e2e[0]['prompt_len']}, gen {e2e[0]['gen']}; "
      f"{rounds} whole-model round(s), llama-bench and bespoke taking turns; llama.cpp decodes at depth "
      f"{depth}" + (" (empty context; bespoke after its prompt)" if not depth else ", after the prompt as bespoke") + "\n")
print(f"{'metric':<44} {'bespoke':>10} {'llama.cpp':>10} {'ratio':>7}  {'range':>11}")
for label, b, l, rr in rows:
    ratio = rr[0] if rr else (b / l if b and l else float("nan"))
    spread = f"{rr[1]:.2f}-{rr[2]:.2f}" if rr and rounds > 1 else ""
    print(f"{label:<44} {f(b)} {f(l)} {ratio:7.2f}  {spread:>11}")
print("""
ratio = bespoke / llama.cpp (> 1: bespoke faster). tok/s rows: the median of each side over the rounds,
and the median (range: lowest-highest) of the per-round ratios. GB/s = weight bytes per matvec / time.
Same-shape rows: test-backend-ops --test-file at bespoke's shapes, weights cache-resident in both.
* rows: llama.cpp's own perf shape, so GB/s per type (bespoke: its best streamed shape). llama.cpp's
times include converting the activations (to bf16 / q8_0); bespoke's fp4 kernels take f32 activations,
its fp4xq8 ones int8 (the closer match); bespoke's bf16 kernels f32 activations, its bf16dot ones
(--bf16-act bf16) BF16, as llama.cpp's; amx rows (--bf16-act amx) prefill BF16 activations on AMX
tiles and decode as the f32 rows (llama.cpp's CPU backend has no AMX path for BF16 weights).
! llama-bench's repeats spread by more than 10% in a round
(was the machine busy?).""")
EOF
say "saved $TXT (raw outputs: $RUN)"
