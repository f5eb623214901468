"""llmc-fsm-clip-rtn: a third-party llmc-fsm plugin built on the public toolkit only.

Registers ``ClippedRTNModifier`` (recipe name) through the ``llmc_fsm`` entry-point group. The modifier derives from
:class:`llmc_fsm.toolkit.CalibratedModifier`; the algorithm, :func:`search_clip_ratios`, is a plain tensor function.
"""

from __future__ import annotations

from llmc_fsm import Modifier, hookimpl
from llmc_fsm_clip_rtn.clipping import ClipSearch, clip_ratios, quantize_rows, search_clip_ratios
from llmc_fsm_clip_rtn.modifier import ClippedRTNModifier

__all__ = [
    "ClipSearch",
    "ClippedRTNModifier",
    "clip_ratios",
    "llmc_fsm_register_modifiers",
    "quantize_rows",
    "search_clip_ratios",
]


@hookimpl
def llmc_fsm_register_modifiers() -> list[type[Modifier]]:
    """Register :class:`ClippedRTNModifier`."""
    return [ClippedRTNModifier]
