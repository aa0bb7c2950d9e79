#!/usr/bin/env bash
# attnplug's main job (README): a tiny Llama with real random weights served by a real engine with
# --attention-backend attnplug_triton, one request, the completion and whether it matches the
# engine's native backend. Builds the engine's virtual environment on first use.
# Usage: scripts/main.sh [vllm|sglang]   (default vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${1:-vllm}
case $engine in
  vllm|sglang) ;;
  *) echo "usage: scripts/main.sh [vllm|sglang]" >&2; exit 2 ;;
esac
bash "scripts/setup_${engine}_env.sh"
exec ".venvs/$engine/bin/python" -m "attnplug.demo_$engine"
