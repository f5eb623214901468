"""llmc-fsm quantization plugin: GPTQ and round-to-nearest, saved in the compressed-tensors format.

Installed as its own distribution (``llmc-fsm-quantization``) and discovered by
llmc-fsm through the ``llmc_fsm`` entry-point group, exactly like a third-party
plugin. Recipe names: ``GPTQModifier``, ``QuantizationModifier``, ``AWQModifier``,
``SmoothQuantModifier``, ``LogarithmicEqualizationModifier``, ``AutoRoundModifier``, ``SpinQuantModifier``. Schemes,
argument types, qparams and packing come from ``compressed-tensors``.
"""

from __future__ import annotations

import llmc_fsm
from llmc_fsm_quantization._base import QuantizedWeight, attach_qparams
from llmc_fsm_quantization.autoround import AutoRoundModifier
from llmc_fsm_quantization.awq import AWQModifier
from llmc_fsm_quantization.gptq import GPTQModifier, gptq_quantize
from llmc_fsm_quantization.kv_cache import load_kv_cache_scales
from llmc_fsm_quantization.mappings import AWQMapping
from llmc_fsm_quantization.observers import observe
from llmc_fsm_quantization.rotations import SpinQuantModifier
from llmc_fsm_quantization.rtn import QuantizationModifier, rtn_quantize
from llmc_fsm_quantization.schemes import preset_names, resolve_scheme
from llmc_fsm_quantization.smoothquant import LogarithmicEqualizationModifier, SmoothQuantModifier

__all__ = [
    "AWQMapping",
    "AWQModifier",
    "AutoRoundModifier",
    "GPTQModifier",
    "LogarithmicEqualizationModifier",
    "QuantizationModifier",
    "QuantizedWeight",
    "SmoothQuantModifier",
    "SpinQuantModifier",
    "attach_qparams",
    "gptq_quantize",
    "llmc_fsm_register_modifiers",
    "load_kv_cache_scales",
    "observe",
    "preset_names",
    "resolve_scheme",
    "rtn_quantize",
]


@llmc_fsm.hookimpl
def llmc_fsm_register_modifiers() -> list[type[llmc_fsm.Modifier]]:
    """Register the quantization modifiers."""
    return [
        AutoRoundModifier,
        GPTQModifier,
        QuantizationModifier,
        AWQModifier,
        SmoothQuantModifier,
        LogarithmicEqualizationModifier,
        SpinQuantModifier,
    ]


#: a name an llm-compressor script imports, explained in one line (see :func:`llmc_fsm.plugin_getattr`)
_NOTES = {
    "fix_batch_if_needed": (
        "fix_batch_if_needed is llm-compressor's AutoRound mask fix (it zeroes the last attention_mask position of an "
        "unpadded row); llmc-fsm needs none: leave out the dataset.map(fix_batch_if_needed) line "
        '(docs/oneshot.md, "Datasets from llm-compressor scripts")'
    )
}
__getattr__ = llmc_fsm.plugin_getattr(__name__, _NOTES)
