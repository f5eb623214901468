"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


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
    from llmc_fsm.models import load_model

    return load_model("smollm2-135m")
