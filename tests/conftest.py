"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _perplexity_cache(tmp_path_factory, monkeypatch):
    """Each test its own (empty) dense-perplexity cache (:class:`llmc_fsm.data.protocol.PerplexityCache`)."""
    monkeypatch.setenv("LLMC_FSM_PERPLEXITY_CACHE", str(tmp_path_factory.mktemp("perplexity-cache")))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real-data folder: ``$LLMC_FSM_DATA`` if set, else ``<repo>/../shared/data``.

    Fails (does not skip) when the folder or its expected files are missing.
    """
    env = os.environ.get("LLMC_FSM_DATA")
    root = Path(env).expanduser() if env else REPO_ROOT.parent / "shared" / "data"
    expected = ["wikitext-2-raw/wiki.test.raw", "tinyshakespeare/input.txt"]
    missing = [name for name in expected if not (root / name).is_file()]
    if missing:
        source = "$LLMC_FSM_DATA" if env else "<repo>/../shared/data (set LLMC_FSM_DATA to override)"
        pytest.fail(f"real test data missing under {root} [{source}]: {', '.join(missing)}", pytrace=False)
    return root


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` for SmolLM2-135M via ``load_model`` (cached; first run converts the GGUF, ~30 s).

    Shared by the whole session: do not modify the model in place (``copy.deepcopy`` it first).
    """
    from llmc_fsm.models.known import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_oneshot(smollm2, shared_data):
    """``run(recipe, output_dir=None)``: ``llmc_fsm.oneshot`` on a copy of SmolLM2; returns the compressed model.

    Calibration 16 x 128 tokens from the tail of wikitext-2 test, perplexity on 8 x 128 tokens from its head.
    """
    import copy

    import llmc_fsm

    model, tokenizer = smollm2
    wiki = shared_data / "wikitext-2-raw" / "wiki.test.raw"

    def run(recipe: dict, output_dir: Path | None = None):
        return llmc_fsm.oneshot(
            model=copy.deepcopy(model),
            tokenizer=tokenizer,
            recipe=recipe,
            dataset=wiki,
            num_calibration_samples=16,
            max_seq_length=128,
            eval_text=wiki,
            num_eval_windows=8,
            output_dir=output_dir,
            progress=False,
        )

    return run


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> tuple[Path, Path]:
    """``(model directory, calibration text file)`` of ``tiny_llama.build`` (4 layers), one per test module."""
    import tiny_llama

    return tiny_llama.build_with_text(tmp_path_factory.mktemp("tiny"))
