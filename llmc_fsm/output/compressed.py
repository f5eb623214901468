"""How a quantized model is written down in its checkpoint: the weight format and the config's targets.

Both work around what ``compressed-tensors`` 0.20 would write by default and
transformers 5 then does not load as written; :mod:`llmc_fsm.output.save` applies them
when saving. Each takes ``{name: module}`` of the quantized modules
(:func:`llmc_fsm.output.save.quantized_modules`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["leaf_targets", "unpacked_zero_points"]


def unpacked_zero_points(modules: dict[str, nn.Module]) -> None:
    """Asymmetric int weights that compressed-tensors would pack are saved ``int-quantized`` (int8 per weight).

    ``pack-quantized`` packs their zero points too, and transformers 5 with compressed-tensors 0.20 then refuses
    the checkpoint (it allocates unpacked zero points: size mismatch). Unpacked, W4A16_ASYM and asymmetric W4A8 /
    W6A16 / W8A16 load with logits equal to the in-memory model's. Symmetric schemes stay ``pack-quantized``.
    Sets ``quantization_scheme.format`` of those modules.
    """
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat

    for sub in modules.values():
        scheme = sub.quantization_scheme
        asymmetric_int = scheme.weights is not None and not scheme.weights.symmetric and scheme.weights.type == "int"
        if asymmetric_int and scheme.format in (None, CompressionFormat.pack_quantized):
            scheme.format = None
            if infer_module_format(type(sub), scheme) == CompressionFormat.pack_quantized:
                scheme.format = CompressionFormat.int_quantized


@contextlib.contextmanager
def leaf_targets(modules: dict[str, nn.Module]) -> Iterator[None]:
    """While inside, each quantized module's scheme targets the modules actually quantized with it.

    A modifier's ``targets`` may name containers (``LlamaMLP``, ``model.layers.0``, ``re:model.layers.\\d*$``,
    ``__ALL__``); copied into ``config_groups`` as they are, transformers applies them to the containers on
    reload and the checkpoint fails to load or loads with re-initialised weights. One scheme: its targets
    become the quantized modules' class names (``["Linear"]``), and compressed-tensors lists every other module
    of those classes under ``ignore``. Several schemes: each targets the exact names of its modules.
    """
    saved = {name: list(sub.quantization_scheme.targets) for name, sub in modules.items()}
    groups: dict[str, list[str]] = {}
    for name, sub in modules.items():
        groups.setdefault(sub.quantization_scheme.model_dump_json(exclude={"targets"}), []).append(name)
    if len(groups) == 1:
        classes = sorted({type(sub).__name__ for sub in modules.values()})
        targets = {name: classes for name in modules}
    else:
        targets = {name: sorted(names) for names in groups.values() for name in names}
    try:
        for name, sub in modules.items():
            sub.quantization_scheme.targets = targets[name]
        yield
    finally:
        for name, sub in modules.items():
            sub.quantization_scheme.targets = saved[name]
