"""What a one-shot job is asked to do: the default model and the recipe generated from ``--method`` and its flags."""

from __future__ import annotations

from typing import Any

from llmc_fsm.recipes.building import build_recipe
from llmc_fsm.recipes.model import Recipe

__all__ = ["DEFAULT_MODEL", "GENERATED", "METHODS", "default_recipe", "generated_recipe"]

#: The model used when none is given: SmolLM2-135M-Instruct (see :mod:`llmc_fsm.models.known`).
DEFAULT_MODEL = "smollm2-135m"

#: ``--method`` -> (modifier, stage name of the generated recipe).
METHODS = {
    "sparsegpt": ("SparseGPTModifier", "sparsity_stage"),
    "wanda": ("WandaPruningModifier", "sparsity_stage"),
    "magnitude": ("MagnitudePruningModifier", "sparsity_stage"),
    "gptq": ("GPTQModifier", "quantization_stage"),
    "rtn": ("QuantizationModifier", "quantization_stage"),
}


def default_recipe(
    method: str = "sparsegpt",
    sparsity: float = 0.5,
    mask_structure: str = "unstructured",
    *,
    scheme: str = "W4A16",
    group_size: int | None = None,
    observer: str | None = None,
) -> dict:
    """The recipe used when none is given: ``method`` on every Linear except ``lm_head``.

    Pruning methods (``sparsegpt`` — the default —, ``wanda``, ``magnitude``) use
    ``sparsity`` and ``mask_structure``; quantization methods (``gptq``,
    ``rtn``) use ``scheme`` (a compressed-tensors preset), with the weights'
    ``group_size`` replaced when given (SmolLM2's width 576 needs 64), and
    ``observer`` (``minmax``, the modifiers' default, or ``mse``) when given.

    Raises:
        ValueError: unknown method.
    """
    try:
        name, stage = METHODS[method]
    except KeyError:
        msg = f"unknown method {method!r}; choose one of {', '.join(METHODS)}"
        raise ValueError(msg) from None
    args: dict[str, Any] = {"targets": ["Linear"], "ignore": ["lm_head"]}
    if stage == "sparsity_stage":
        args.update(sparsity=sparsity, mask_structure=mask_structure)
    else:
        args["scheme"] = scheme if group_size is None else {"preset": scheme, "weights": {"group_size": group_size}}
        if observer is not None:
            args["observer"] = observer
    return {stage: {name: args}}


#: The source of :func:`generated_recipe` recipes (as recipe error messages name it).
GENERATED = "generated from --method/--sparsity/--mask-structure/--scheme/--group-size/--block-size/--observer"


def generated_recipe(*args: Any, **kw: Any) -> Recipe:
    """:func:`default_recipe` (same arguments) as a :class:`~llmc_fsm.Recipe` whose source is :data:`GENERATED`.

    Run again on a saved output, its stage is skipped when the same settings were applied, and otherwise runs
    (under a fresh name, ``sparsity_stage_2``, when its name was applied); see
    :func:`llmc_fsm.recipes.history.merge_saved_recipe`.

    Raises:
        ValueError: unknown method; RecipeError: an invalid argument (e.g. the scheme).
    """

    return build_recipe(default_recipe(*args, **kw), GENERATED)
