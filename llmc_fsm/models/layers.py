"""Finding a model's decoder layers: the blocks the sequential pipeline calibrates and compresses one at a time."""

from __future__ import annotations

from torch import nn

__all__ = ["find_decoder_layers"]


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Return ``(qualified name, ModuleList)`` of the model's decoder layers.

    The decoder layers are the largest ``nn.ModuleList`` whose children all
    have the same class (``model.model.layers`` for Llama-style models); ties go
    to the one found first.

    Raises:
        ValueError: no ``ModuleList`` of same-class blocks exists.
    """
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and (best is None or len(module) > len(best[1])):
                best = (name, module)
    if best is None:
        msg = (
            f"cannot find the decoder layers of {type(model).__name__}: the sequential pipeline needs an "
            "nn.ModuleList of same-class blocks (e.g. model.model.layers)"
        )
        raise ValueError(msg)
    return best
