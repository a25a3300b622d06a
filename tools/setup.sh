#!/usr/bin/env bash
# Install what building bespoke needs beyond Rust: a C compiler and libclang
# (for bindgen), and with --cuda the CUDA compiler from PyPI (for the `cuda`
# feature and the CUDA build tests). Debian/Ubuntu; safe to run again. Used by
# .ci/run too.
set -euo pipefail

need=()
command -v cc >/dev/null 2>&1 || need+=(gcc)
# --cuda: the `cuda` feature compiles the CPU emulator of the CUDA kernels as
# C++ (and nvcc wants a host C++ compiler).
case " $* " in *" --cuda "*) command -v c++ >/dev/null 2>&1 || need+=(g++) ;; esac
# bindgen loads libclang at build time.
# (libclang-cpp, which some images ship alone, is not what bindgen loads.)
found=$(ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/llvm-*/lib/libclang-[0-9]*.so* \
  /usr/lib/*-linux-gnu/libclang.so* /usr/lib/*-linux-gnu/libclang-[0-9]*.so* 2>/dev/null | head -1 || true)
if [ -z "$found" ] && [ -z "${LIBCLANG_PATH:-}" ]; then
  need+=(libclang-dev)
fi
if ((${#need[@]})); then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: please install: ${need[*]} (a C compiler, C++ for --cuda, and libclang for bindgen)" >&2
    exit 1
  fi
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null 2>&1 || { echo "setup: cargo not found: install Rust (https://rustup.rs)" >&2; exit 1; }

# --cuda: the CUDA compiler from PyPI (nvcc, ptxas, headers: the wheels
# nvidia-cuda-nvcc, nvidia-cuda-runtime, nvidia-cuda-cccl, nvidia-nvvm) into a
# virtualenv under ~/.cache/bespoke, with ~/.cache/bespoke/cuda-home pointing
# at the toolkit directory; build.rs and the tests look there when CUDA_HOME is
# not set. No GPU or driver is needed to compile. A toolkit already on the
# machine (CUDA_HOME or nvcc on PATH) is used as it is.
if [ "${1:-}" = "--cuda" ]; then
  cache="${XDG_CACHE_HOME:-$HOME/.cache}/bespoke"
  if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
    echo "setup: using the CUDA toolkit in CUDA_HOME=$CUDA_HOME" >&2
  elif command -v nvcc >/dev/null 2>&1; then
    echo "setup: using $(command -v nvcc)" >&2
  elif [ -x "$cache/cuda-home/bin/nvcc" ]; then
    echo "setup: CUDA compiler already installed in $cache/cuda-home" >&2
  else
    py=$(command -v python3 || true)
    [ -n "$py" ] || { echo "setup: --cuda needs python3 (for pip)" >&2; exit 1; }
    if ! "$py" -m venv --help >/dev/null 2>&1; then
      echo "setup: python3 has no venv module (apt-get install python3-venv)" >&2; exit 1
    fi
    mkdir -p "$cache"
    echo "setup: installing the CUDA compiler wheels from PyPI into $cache/cuda (a few hundred MB, once)" >&2
    "$py" -m venv "$cache/cuda"
    "$cache/cuda/bin/pip" install -q --disable-pip-version-check \
      nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-cccl nvidia-nvvm
    nvcc=$(find "$cache/cuda" -path '*/nvidia/*/bin/nvcc' -type f | head -1)
    [ -n "$nvcc" ] || { echo "setup: the nvcc wheel installed no nvcc" >&2; exit 1; }
    ln -sfn "$(dirname "$(dirname "$nvcc")")" "$cache/cuda-home"
    "$cache/cuda-home/bin/nvcc" --version | tail -2 >&2
  fi
fi
