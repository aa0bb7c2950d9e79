#!/usr/bin/env bash
# FlashInfer 0.7.4 for the offline H200 (Python 3.12, torch 2.11 cu130), next to the 0.6.14 bundle of
# shared/tools/gpu-wheels.sh. Its wheel is 97 MiB, over the device tool's 64 MiB carry per call, so it
# travels in two parts of <= 60 MiB and is put back together on the device.
#
#   here:   bash scripts/gpu-wheels-fi074.sh prepare [.gpu074]
#           -> .gpu074/a (part 1 of the wheel), .gpu074/b (part 2 + the small wheels its import needs:
#              apache-tvm-ffi, cuda-tile, nvidia-ml-py, requests, urllib3, idna, certifi); keep out of git
#   device, call 1 (carry [".gpu074/a"]):  bash scripts/gpu-wheels-fi074.sh stash
#   device, call 2 (carry [".gpu074/b"], same warm machine):
#           bash scripts/gpu-wheels-fi074.sh assemble && \
#           ATTNPLUG_GPU_DIR=/tmp/fi074/wheels ATTNPLUG_SITE=/tmp/site-fi074 bash scripts/gpu_run.sh \
#             python -m pytest tests/gpu -q -rs -k flashinfer --timeout 120
#   device, call 3 (no carry): ATTNPLUG_GPU_DIR=/tmp/fi074/wheels ATTNPLUG_SITE=/tmp/site-fi074 \
#             bash scripts/gpu_run.sh python -m attnplug.bench --providers flashinfer,torch --out "$OUT/bench-fi074" --time-budget 240
# Checked on CPU only: `import flashinfer, flashinfer.decode, flashinfer.prefill` works from exactly
# these wheels on top of torch (2026-11-30); nothing here ran on a GPU yet.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-prepare}
STASH=/tmp/fi074
case $mode in
  prepare)
    DEST=${2:-.gpu074}
    rm -rf "$DEST"; mkdir -p "$DEST/a" "$DEST/b"
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    plat=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform any)
    python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" flashinfer-python==0.7.4 \
      'apache-tvm-ffi>=0.1.11,<0.2' 'cuda-tile>=1.4.0' nvidia-ml-py requests urllib3 idna certifi
    fi=$(ls "$tmp"/flashinfer_python-0.7.4-*.whl)
    (cd "$tmp" && split -b 60M -d "$(basename "$fi")" "$(basename "$fi").part-")
    sha256sum "$fi" | awk '{print $1}' > "$DEST/b/flashinfer.sha256"
    mv "$fi".part-00 "$DEST/a/"; mv "$fi".part-* "$DEST/b/"
    rm "$fi"; mv "$tmp"/*.whl "$DEST/b/"
    du -sh "$DEST"/a "$DEST"/b; ls -la "$DEST"/a "$DEST"/b ;;
  stash)  # device, call 1
    mkdir -p "$STASH"; cp .gpu074/a/* "$STASH/"; ls -la "$STASH" ;;
  assemble)  # device, call 2
    cp .gpu074/b/* "$STASH/"
    mkdir -p "$STASH/wheels"
    whl=flashinfer_python-0.7.4-py3-none-any.whl
    cat "$STASH/$whl".part-* > "$STASH/wheels/$whl"
    [[ "$(sha256sum "$STASH/wheels/$whl" | awk '{print $1}')" == "$(cat "$STASH/flashinfer.sha256")" ]] \
      || { echo "gpu-wheels-fi074: reassembled wheel does not match its sha256"; exit 1; }
    cp "$STASH"/*.whl "$STASH/wheels/"; ls -la "$STASH/wheels" ;;
  *) echo "usage: $0 prepare [DEST] | stash | assemble" >&2; exit 2 ;;
esac
