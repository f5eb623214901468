"""Packed tensors kept on a quantized module for its checkpoint: a quantizer that already had compressed-tensors'
compressor pack a module (NVFP4 / MX / FP8-block weights are packed when they are quantized, so the module holds
exactly the values its checkpoint reloads to) keeps them with :func:`keep_packed`; the save writes them after
:func:`kept_packed` checks they still describe the module, instead of rounding the weight again."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PACKED_ATTR", "keep_packed", "kept_packed"]


#: Attribute of a quantized module holding the tensors its compressor packed when it was quantized
#: (:func:`keep_packed`).
PACKED_ATTR = "packed_for_checkpoint"


def keep_packed(module: nn.Module, fmt: str, packed: dict[str, Any]) -> None:
    """Keep on ``module`` what compressed-tensors' compressor of format ``fmt`` (e.g. ``"nvfp4-pack-quantized"``)
    packed from it (``compress``'s state dict: ``weight_packed``, ``weight_scale``, ...), for the save to write
    instead of compressing the module again (rounding its weight again: NVFP4 / MX / FP8-block weights are packed
    when they are quantized, to give the module the values its checkpoint reloads to). :func:`kept_packed` checks
    that they still describe the module before they are used."""
    setattr(module, PACKED_ATTR, (fmt, packed))


def kept_packed(module: nn.Module, fmt: str, local: dict[str, Any]) -> dict[str, Any] | None:
    """The tensors :func:`keep_packed` kept on ``module`` if they are what compressing it now in format ``fmt``
    would give, else ``None`` (nothing kept, another format, or the module changed since).

    ``local``: the module's own state dict (``weight``, ``weight_scale``, ...). They are current when decompressing
    them gives ``local["weight"]`` bit for bit and the other tensors decompressing gives back (scales, global
    scale) equal ``local``'s (compared in ``local``'s dtype); compressing ``local`` then gives them again (the
    compressor's rounding maps its own decompressed values back to the same codes; a tensor the compressor drops,
    such as a symmetric scheme's zero point, is dropped either way)."""
    kept = getattr(module, PACKED_ATTR, None)
    if kept is None or kept[0] != fmt:
        return None
    from compressed_tensors.compressors import BaseCompressor

    packed = kept[1]
    restored = BaseCompressor.get_value_from_registry(fmt).decompress(packed, module.quantization_scheme)
    if "weight" not in restored or any(local.get(key) is None for key in restored):
        return None
    for key, value in restored.items():
        if value.shape != local[key].shape or not torch.equal(value.to(local[key].dtype), local[key]):
            return None
    return packed
