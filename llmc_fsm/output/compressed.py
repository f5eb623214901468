"""How a quantized model is written down in its checkpoint: the weight format and the config's targets.

Both work around what ``compressed-tensors`` 0.20 would write by default and
transformers 5 then does not load as written; :mod:`llmc_fsm.output.save` applies them
when saving. Each takes ``{name: module}`` of the quantized modules
(:func:`llmc_fsm.output.save.quantized_modules`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from llmc_fsm.models.hf_io import checkpoint_key_renamer

__all__ = [
    "attention_scheme",
    "ignore_for_reload",
    "kv_cache_scheme",
    "leaf_targets",
    "unpacked_embeddings",
    "unpacked_zero_points",
    "with_saved_names",
]

#: Attribute of an attention module whose KV cache is quantized: its compressed-tensors ``QuantizationArgs``
#: (set by the quantization plugin, next to its ``k_scale`` / ``v_scale`` parameters).
KV_CACHE_SCHEME_ATTR = "kv_cache_scheme"
#: Attribute of an attention module whose queries are quantized too (attention quantization): the config group's
#: ``QuantizationScheme`` (input activations only; set by the quantization plugin, next to ``q_scale``).
ATTENTION_SCHEME_ATTR = "attention_quantization_scheme"


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


def unpacked_embeddings(modules: dict[str, nn.Module]) -> None:
    """Quantized ``nn.Embedding`` weights that compressed-tensors would pack are saved ``int-quantized``.

    ``pack-quantized`` replaces an embedding's ``weight`` by ``weight_packed``, and transformers 5.24 then fails
    to reload the checkpoint: its weight initialisation reads ``Embedding.weight`` (``AttributeError:
    'Embedding' object has no attribute 'weight'``, measured with compressed-tensors 0.20). ``int-quantized``
    keeps the integer values under ``weight`` (one int8 per value) and reloads with logits equal to the in-memory
    model's (W4A16 / W4A16_ASYM group 32, int8 per channel). Sets ``quantization_scheme.format`` of those modules.
    """
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat

    for sub in modules.values():
        if not isinstance(sub, nn.Embedding):
            continue
        scheme = sub.quantization_scheme
        if scheme.format in (None, CompressionFormat.pack_quantized):
            scheme.format = None
            if infer_module_format(type(sub), scheme) == CompressionFormat.pack_quantized:
                scheme.format = CompressionFormat.int_quantized


@contextlib.contextmanager
def leaf_targets(
    modules: dict[str, nn.Module], *, by_name: bool = False, model: nn.Module | None = None
) -> Iterator[None]:
    """While inside, each quantized module's scheme targets the modules actually quantized with it.

    The recipe's targets are kept (as llm-compressor writes them: ``re:.*self_attn.*``, ``Linear``) when ``model``
    (the saved model, whose module names are those transformers reloads) is given, ``by_name`` is not, and they
    select exactly what was quantized the way transformers 5.25 applies a config on reload: each ``nn.Linear`` /
    ``nn.Embedding`` of ``model`` that a group's targets match (compressed-tensors' ``is_match``: name, ``re:``
    pattern or class in its MRO) is quantized with that group's scheme, and with no other group's targets matching
    it (a matched module that was not quantized is fine: :func:`ignore_for_reload` lists it under ``ignore``).

    Otherwise they are replaced: a modifier's ``targets`` may name containers (``LlamaMLP``, ``model.layers.0``,
    ``re:model.layers.\\d*$``, ``__ALL__``), which match no quantized module on reload, or two groups' targets may
    overlap. One scheme: its targets become the quantized modules' class names (``["Linear"]``), and
    compressed-tensors lists every other module of those classes under ``ignore``. Several schemes, or ``by_name``
    (another group covers fused experts, whose per-expert matrices a class target would also name): each targets
    the exact names of its modules.
    """
    saved = {name: list(sub.quantization_scheme.targets) for name, sub in modules.items()}
    groups: dict[str, list[str]] = {}
    for name, sub in modules.items():
        groups.setdefault(sub.quantization_scheme.model_dump_json(exclude={"targets"}), []).append(name)
    if model is not None and not by_name and _recipe_targets_select_exactly(model, modules, groups):
        kept = [(names, list(dict.fromkeys(t for n in names for t in saved[n]))) for names in groups.values()]
        targets = {name: group_targets for names, group_targets in kept for name in names}
    elif len(groups) == 1 and not by_name:
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


def _recipe_targets_select_exactly(
    model: nn.Module, modules: dict[str, nn.Module], groups: dict[str, list[str]]
) -> bool:
    """Whether the recipe's targets of each group of ``groups`` (scheme -> names of its ``modules``) select, on
    reload, its modules and only modules of ``model`` left unquantized (:func:`leaf_targets`)."""
    from compressed_tensors.utils.match import is_match

    group_of = {id(modules[name]): key for key, names in groups.items() for name in names}
    wanted = {
        key: list(dict.fromkeys(t for n in names for t in modules[n].quantization_scheme.targets))
        for key, names in groups.items()
    }
    seen = 0
    for name, sub in model.named_modules():
        if not isinstance(sub, nn.Linear | nn.Embedding):  # the only modules a config group quantizes on reload
            continue
        matched = {key for key, targets in wanted.items() if is_match(name, sub, targets)}
        own = group_of.get(id(sub))
        seen += own is not None
        if own is not None and matched != {own}:  # unquantized: ignore_for_reload lists it
            return False
    return seen == len(group_of)  # every quantized module is one of them


def ignore_for_reload(model: nn.Module, modules: dict[str, nn.Module], ignore: list[str]) -> list[str]:
    """``ignore`` plus every module the reloaded model would quantize by class, or by a recipe's name or ``re:``
    target (kept by :func:`leaf_targets`; only Linears and Embeddings, the modules a group quantizes on reload), but
    that was not quantized.

    compressed-tensors lists under ``ignore`` the unquantized modules whose class *is* a target class, while on
    reload a class target also matches subclasses (its ``_match_class`` walks the MRO): a vision tower's
    ``nn.MultiheadAttention.out_proj`` (``NonDynamicallyQuantizableLinear``, an ``nn.Linear``) in SigLIP (Gemma 3,
    PaliGemma) was then reloaded as if quantized and transformers failed to initialise it. Names are the module
    names of ``model``, which are those of the model transformers reloads. Order: ``ignore`` first, then the added
    names in module order.

    Args:
        model: the saved model.
        modules: ``{name: module}`` of its quantized modules (:func:`llmc_fsm.output.save.quantized_modules`).
        ignore: what compressed-tensors wrote.
    """
    from compressed_tensors.utils.match import is_match

    targets = {t for sub in modules.values() for t in sub.quantization_scheme.targets}
    quantized = {id(sub) for sub in modules.values()}
    listed = set(ignore)
    added = [
        name
        for name, sub in model.named_modules()
        if name
        and name not in listed
        and id(sub) not in quantized
        and not isinstance(sub, nn.ModuleList | nn.ModuleDict)
        and (
            any(cls.__name__ in targets for cls in type(sub).__mro__)
            or (isinstance(sub, nn.Linear | nn.Embedding) and is_match(name, sub, sorted(targets)))
        )
    ]
    return with_saved_names(model, [*ignore, *added])


def with_saved_names(model: nn.Module, ignore: list[str]) -> list[str]:
    """``ignore`` with both spellings of each module whose weight transformers saves under another name: beside a
    module name of ``model``, the name ``save_pretrained`` writes its weight under (transformers'
    ``revert_weight_conversion``: Mixtral's router ``model.layers.N.mlp.gate`` is saved as
    ``model.layers.N.block_sparse_moe.gate``, a vision tower's ``model.vision_tower.encoder...`` as
    ``vision_tower.encoder...``), and beside a saved name the module's name (compressed-tensors 0.20 writes the
    saved names for a model that ``from_pretrained`` loaded, and module names for a model built otherwise: the
    checkpoint of a Mixtral built from its config listed ``mlp.gate`` while its tensors are
    ``block_sparse_moe.gate.weight``, found by a tester). transformers reloads into module names, a serving engine
    (vLLM) matches the checkpoint's names; a name that renames to itself, a head tied to the input embedding (not
    saved), a ``re:`` pattern and a name that is neither are kept as they are. Order: each entry, then its other
    spelling."""
    from transformers.core_model_loading import revert_weight_conversion  # optional third-party: transformers

    modules = dict(model.named_modules())
    to_module = checkpoint_key_renamer(model) if hasattr(model, "base_model_prefix") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = getattr(embedding, "weight", None)
    out: list[str] = []
    for name in ignore:
        other = None
        if name.startswith("re:") or to_module is None:
            other = None
        elif name in modules and getattr(modules[name], "weight", None) is tied and modules[name] is not embedding:
            other = None  # a head tied to the input embedding: its weight is not saved, under any name
        elif name in modules and isinstance(getattr(modules[name], "weight", None), nn.Parameter):
            probe = {f"{name}.weight": modules[name].weight}
            other = next(iter(revert_weight_conversion(model, probe)), "").removesuffix(".weight")
        elif name not in modules:
            renamed, pattern = to_module(f"{name}.weight")
            module = renamed.removesuffix(".weight")
            other = module if pattern is None and module in modules else None
        for entry in (name, other):
            if entry and entry not in out:
                out.append(entry)
    return out


def kv_cache_scheme(model: nn.Module) -> Any:
    """The ``kv_cache_scheme`` to write in ``quantization_config``: the ``QuantizationArgs`` that ``model``'s
    attention modules carry (attribute ``kv_cache_scheme``, with their ``k_scale`` / ``v_scale``), or ``None``.

    compressed-tensors 0.20 finds a KV-cache scheme only on attention modules it recognises by a
    ``past_key_values`` argument, which transformers 5.24's attention no longer has (it is ``cache``); so it
    is read here from the modules the quantization plugin calibrated.

    Raises:
        ValueError: two attention modules carry different schemes.
    """
    found = {
        name: args
        for name, sub in model.named_modules()
        if (args := getattr(sub, KV_CACHE_SCHEME_ATTR, None)) is not None
    }
    schemes = {args.model_dump_json(): name for name, args in found.items()}
    if len(schemes) > 1:
        first, second = list(schemes.values())[:2]
        raise ValueError(f"{first} and {second} quantize their KV cache with different schemes; one is written")
    return next(iter(found.values()), None)


def attention_scheme(model: nn.Module) -> Any:
    """The config group of attention quantization to write in ``quantization_config``: the ``QuantizationScheme``
    (input activations only, targets as the recipe gave them) ``model``'s attention modules carry, or ``None``.

    compressed-tensors 0.20 writes it only for attention modules it hooked itself (recognised by a
    ``past_key_values`` argument, which transformers 5.24's attention no longer has); so it is read here from the
    modules the quantization plugin calibrated.
    """
    return next(
        (scheme for sub in model.modules() if (scheme := getattr(sub, ATTENTION_SCHEME_ATTR, None)) is not None), None
    )
