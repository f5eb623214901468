"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

_CUDA_NOT_RUN: list[str] = []  # node ids of the tests marked cuda that this run could not run


def _cuda_missing() -> str | None:
    """Why CUDA tests cannot run here, or ``None`` when torch sees a CUDA device."""
    import torch

    if torch.cuda.is_available():
        return None
    return f"torch {torch.__version__} (built with CUDA {torch.version.cuda or 'none'}) sees no CUDA device"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cuda: needs a CUDA device; run wherever torch sees one, and counted (with the reason) in the terminal "
        "summary where not",
    )


@pytest.hookimpl(trylast=True)  # after -k / -m deselected what this run does not select
def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped, with the reason, where torch sees no CUDA device — and counted, so that
    the terminal summary says how many were not run (never silently)."""
    reason = _cuda_missing()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {reason}"))
            _CUDA_NOT_RUN.append(item.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _CUDA_NOT_RUN:
        terminalreporter.write_sep("=", "CUDA tests not run", yellow=True)
        terminalreporter.write_line(
            f"{len(_CUDA_NOT_RUN)} CUDA test(s) not run: {_cuda_missing()}; run them on a machine with a GPU "
            "(python -m pytest -m cuda)"
        )


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


@pytest.fixture(autouse=True)
def _keep_glibcs_allocator(monkeypatch):
    """A streamed calibrated run (the CLI's default) fixes glibc's mmap threshold for the rest of the process
    (:func:`llmc_fsm.toolkit.heap.limit_heap_growth`); in-process CLI tests would leave the rest of the test session
    paying a page fault per page of every large tensor. Tests of that call patch it themselves."""
    monkeypatch.setattr("llmc_fsm.oneshot_job.streaming.limit_heap_growth", lambda: False)
