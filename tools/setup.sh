#!/usr/bin/env bash
# Install what building bespoke needs beyond Rust: a C compiler and libclang
# (for bindgen). Debian/Ubuntu; safe to run again. Used by .ci/run too.
set -euo pipefail

need=()
command -v cc >/dev/null 2>&1 || need+=(gcc)
# bindgen loads libclang at build time.
found=$(ls /usr/lib/llvm-*/lib/libclang*.so* /usr/lib/*-linux-gnu/libclang*.so* 2>/dev/null | head -1 || true)
if [ -z "$found" ] && [ -z "${LIBCLANG_PATH:-}" ]; then
  need+=(libclang-dev)
fi
if ((${#need[@]})); then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: please install: ${need[*]} (a C compiler and libclang for bindgen)" >&2
    exit 1
  fi
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null 2>&1 || { echo "setup: cargo not found: install Rust (https://rustup.rs)" >&2; exit 1; }
