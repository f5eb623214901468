"""``quiet_progress``: silence the progress bars of the libraries a one-shot run goes through, then restore them.

``progress=False`` (``--no-progress``) must silence more than our own bars:
transformers (loading and writing weights), huggingface_hub (downloads),
datasets (loading) and compressed-tensors (applying a quantization config and
(de)compressing when transformers loads a quantized model). The first three
have public switches (``disable_progress_bar()`` and friends); compressed-tensors
calls ``tqdm`` directly in ``apply_quantization_config`` and
``ModelCompressor.compress_model``/``decompress_model`` (``show_progress`` is
not passed through by transformers), so its modules' ``tqdm`` name is replaced
by one that always passes ``disable=True`` for the duration. Every setting is
put back as it was when the block exits, so a caller's own choice stands.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["TQDM_MODULES", "quiet_progress"]

#: Modules whose module-level ``tqdm`` draws bars outside transformers' progress switch: compressed-tensors' (loading,
#: saving) and transformers' GGUF reader (a known model's first-run conversion).
TQDM_MODULES = (
    "compressed_tensors.quantization.lifecycle.apply",
    "compressed_tensors.compressors.model_compressors.model_compressor",
    "transformers.modeling_gguf_pytorch_utils",
)


def _silenced(tqdm: Callable[..., Any]) -> Callable[..., Any]:
    def silent(*args: Any, **kwargs: Any) -> Any:
        kwargs["disable"] = True
        return tqdm(*args, **kwargs)

    silent.__wrapped__ = tqdm  # type: ignore[attr-defined]
    return silent


@contextlib.contextmanager
def _hf_switches() -> Iterator[None]:
    """Turn off the bars of transformers, huggingface_hub and datasets (those installed); restore their state."""
    restore: list[Callable[[], None]] = []
    with contextlib.suppress(ImportError):
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        if not are_progress_bars_disabled():
            disable_progress_bars()
            restore.append(enable_progress_bars)
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            hub_was_on = bool(restore)

            def back_on() -> None:
                hf_logging.enable_progress_bar()  # also re-enables huggingface_hub's; undo that if it was off
                if not hub_was_on:
                    disable_progress_bars()

            restore.append(back_on)
    if "datasets" in sys.modules:
        datasets = sys.modules["datasets"]
        if datasets.is_progress_bar_enabled():
            datasets.disable_progress_bars()
            restore.append(datasets.enable_progress_bars)
    try:
        yield
    finally:
        for undo in reversed(restore):
            undo()


@contextlib.contextmanager
def quiet_progress(quiet: bool = True) -> Iterator[None]:
    """Inside the block, no progress bars from transformers, huggingface_hub, datasets or compressed-tensors.

    A no-op when ``quiet`` is false. Not thread-safe (the switches are process-wide).
    """
    if not quiet:
        yield
        return
    patched = []
    for name in TQDM_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        original = getattr(module, "tqdm", None)
        if callable(original):
            module.tqdm = _silenced(original)
            patched.append((module, original))
    try:
        with _hf_switches():
            yield
    finally:
        for module, original in patched:
            module.tqdm = original
