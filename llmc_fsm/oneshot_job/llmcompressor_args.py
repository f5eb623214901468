"""llm-compressor's ``oneshot`` keyword arguments that :func:`llmc_fsm.oneshot` does not have.

Scripts written for llm-compressor 0.14 pass more than ``model``, ``recipe``, ``dataset``, ``num_calibration_samples``
and ``max_seq_length`` (the arguments both share): counted over its 124 example scripts, ``shuffle_calibration_samples``
(20), ``data_collator`` (19), ``sequential_targets`` (15), ``splits`` (13), ``processor`` (11),
``moe_calibrate_all_experts`` (11), ``pipeline``, ``save_compressed``, ``propagate_error``,
``preprocessing_num_workers``, ``dataloader_num_workers``, ``trust_remote_code_model``... Python would refuse each
with a bare ``TypeError``; :func:`check_llmcompressor_args` says instead, for every one given, what llmc-fsm does
with it: the same thing under another name (``processor`` is the tokenizer), nothing that changes the result (the
worker counts; the values that are llmc-fsm's behaviour anyway, e.g. ``pipeline="sequential"``), or a refusal
naming what to do. :data:`LLMCOMPRESSOR_ARGS` is the table; docs/oneshot.md "Arguments from llm-compressor scripts"
carries it for readers.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from llmc_fsm.data.rows import registered_name_error
from llmc_fsm.oneshot_job.settings import generated_recipe
from llmc_fsm.recipes.building import resolve_recipe
from llmc_fsm.recipes.llmcompressor import is_numpy_scalar

__all__ = ["LLMCOMPRESSOR_ARGS", "LlmcompressorArg", "check_llmcompressor_args", "modifiers_reading_data"]

logger = logging.getLogger(__name__)


@attrs.frozen
class LlmcompressorArg:
    """What llmc-fsm does with one llm-compressor ``oneshot`` argument.

    Attributes:
        accept: the values taken (``None``: any value); another value is refused with ``note``.
        note: why, and what to do instead (shown when refused, logged when taken).
        rename: the llmc-fsm argument that receives the value, or ``None`` (taken with no effect on the result).
        taken: what the warning line says when an accepted value is given, where ``note`` speaks to a refused one;
            a mapping gives each accepted value its own line.
    """

    accept: tuple[Any, ...] | None
    note: str
    rename: str | None = None
    taken: str | Mapping[Any, str] | None = None  # the line logged when an accepted value is given (default: note)

    def taken_line(self, value: Any) -> str:
        """The line logged when ``value`` (accepted) is given: its own in ``taken``, else ``taken``, else ``note``."""
        if isinstance(self.taken, Mapping):
            return next((line for v, line in self.taken.items() if _same(value, v)), self.note)
        return self.taken or self.note


#: llm-compressor ``oneshot`` argument -> what llmc-fsm does with it.
LLMCOMPRESSOR_ARGS: dict[str, LlmcompressorArg] = {
    "processor": LlmcompressorArg(None, "the tokenizer (or a multimodal model's processor)", rename="tokenizer"),
    "save_compressed": LlmcompressorArg(
        (True,),
        "llmc-fsm writes a quantized model compressed (compressed-tensors) only; leave it out",
        taken="llmc-fsm writes a quantized model compressed (compressed-tensors)",
    ),
    "pipeline": LlmcompressorArg(
        ("sequential", "independent", "datafree"),
        "llmc-fsm calibrates layer by layer (llm-compressor's 'sequential'; data-free recipes read no data, and take "
        "'datafree'), and has no 'basic' or 'layer_sequential' pipeline: leave it out",
        taken={
            "sequential": "llmc-fsm calibrates layer by layer, as llm-compressor's 'sequential' (data-free recipes "
            "read no data)",
            "independent": "llmc-fsm calibrates layer by layer in one pass, every modifier of a stage at each layer "
            "(llm-compressor's 'sequential'), where llm-compressor's 'independent' gives each modifier a calibration "
            "pass of its own: for one pass per modifier, put each modifier in a stage of its own",
            "datafree": "no modifier of this recipe reads calibration data, so none is read, as llm-compressor's "
            "'datafree'",
        },
    ),
    "splits": LlmcompressorArg(
        (None,),
        "pass the split's rows themselves: a text/JSONL file, a datasets.Dataset (load_dataset(...)[split]) or "
        "token ids",
    ),
    "data_collator": LlmcompressorArg(
        (None, "truncation"),
        "llmc-fsm batches calibration rows itself, only rows of the same length together (no padding, no token cut; "
        "llm-compressor's default 'truncation' cuts each batch to its shortest row: nothing at its default "
        "batch_size 1, the tokens past each batch's shortest row at a larger one, which llmc-fsm keeps); image "
        "calibration data is a directory with metadata.jsonl (docs/oneshot.md)",
    ),
    "moe_calibrate_all_experts": LlmcompressorArg(
        (False,),
        "set calibrate_all_experts: true on the modifier instead (GPTQ, SparseGPT, Wanda, AutoRound...; "
        "docs/architectures.md): llmc-fsm routes each token to its own experts by default, where llm-compressor's "
        "default sends every token through every expert",
        taken="llmc-fsm routes each token to its own experts (its default), as asked",
    ),
    "propagate_error": LlmcompressorArg(
        (True,),
        "llmc-fsm always passes each layer's outputs on as the next layer's inputs; leave it out",
    ),
    "preprocessing_num_workers": LlmcompressorArg(None, "a worker count: it changes no result here"),
    "dataloader_num_workers": LlmcompressorArg(None, "a worker count: it changes no result here"),
    "trust_remote_code_model": LlmcompressorArg(
        (False,), "llmc-fsm loads transformers' own model classes only (no code from a model repository)"
    ),
    "precision": LlmcompressorArg(None, "the dtype the model is loaded in ('auto', 'float32'...)", rename="dtype"),
    "oneshot_device": LlmcompressorArg(None, "where the layers are calibrated", rename="device"),
    "dataset_config_name": LlmcompressorArg((None,), "give a Hub dataset with its config as dataset='name:config'"),
    "dataset_path": LlmcompressorArg((None,), "give the file itself as dataset"),
    "dvc_data_repository": LlmcompressorArg((None,), "give the file itself as dataset"),
    "text_column": LlmcompressorArg(
        ("text",), "llmc-fsm reads a dataset's 'text' (or 'input_ids') column: rename yours (ds.rename_column)"
    ),
    "concatenate_data": LlmcompressorArg(
        (False,), "a dataset's rows are samples of their own; a text file is cut into windows of max_seq_length"
    ),
    "pad_to_max_length": LlmcompressorArg(
        (False,), "llmc-fsm does not pad calibration samples (padding would enter the statistics); leave it out"
    ),
    "streaming": LlmcompressorArg((False,), "a dataset is read whole; pass the rows you want"),
    "remove_columns": LlmcompressorArg((None,), "llmc-fsm reads only the 'input_ids' or 'text' column"),
    "preprocessing_func": LlmcompressorArg((None,), "map the dataset yourself (ds.map) and pass the result"),
    "model_revision": LlmcompressorArg(
        ("main",),
        "llmc-fsm loads a Hub ID at its main revision (or a local directory, or a known name): pass that revision's "
        "snapshot directory as the model instead (huggingface_hub.snapshot_download(ID, revision=...) gives it)",
        taken="llmc-fsm loads a Hub ID at its main revision",
    ),
    "config_name": LlmcompressorArg((None,), "llmc-fsm reads the model directory's own config.json"),
    "tie_word_embeddings": LlmcompressorArg(
        (True,), "llmc-fsm keeps the model's own tying (a quantized tied embedding is saved apart from its head)"
    ),
    "recipe_args": LlmcompressorArg((None,), "llmc-fsm has no expression language: write the values in the recipe"),
    "stage": LlmcompressorArg((None,), "llmc-fsm runs every stage of the recipe: pass a recipe of that stage"),
    "sequential_targets_per_subgraph": LlmcompressorArg((1,), "llmc-fsm calibrates one decoder layer at a time"),
    "use_loss_mask": LlmcompressorArg((False,), "llmc-fsm calibrates on every token of a sample"),
    "enable_compile": LlmcompressorArg((False,), "llmc-fsm does not torch.compile its functions"),
    "overwrite_cache": LlmcompressorArg(None, "a datasets cache setting: it changes no result here"),
    "min_tokens_per_module": LlmcompressorArg(
        None, "a warning threshold for experts: llmc-fsm warns of experts few tokens reach itself"
    ),
    "tracing_ignore": LlmcompressorArg(None, "llmc-fsm traces no graph: it changes no result here"),
    "sequential_offload_device": LlmcompressorArg(
        None, "memory placement of the hidden states (llmc-fsm: activation_budget_mib); it changes no result"
    ),
    "sequential_prefetch": LlmcompressorArg(None, "a prefetch setting: it changes no result here"),
    "quantization_aware_calibration": LlmcompressorArg(None, "deprecated in llm-compressor, where it has no effect"),
    "clear_sparse_session": LlmcompressorArg(None, "each oneshot call has its own session here"),
    "log_dir": LlmcompressorArg(None, "llmc-fsm logs through Python's logging; it changes no result here"),
    "cache_dir": LlmcompressorArg(None, "where Hugging Face downloads go: it changes no result here"),
    "use_auth_token": LlmcompressorArg(None, "Hugging Face authentication: it changes no result here"),
    "distill_teacher": LlmcompressorArg(
        (None,), "distillation runs in a training job here (OutputDistillationModifier, docs/training.md)"
    ),
}


def check_llmcompressor_args(given: Mapping[str, Any], parameters: Mapping[str, Any] | Sequence[str]) -> dict[str, Any]:
    """Check ``given`` keyword arguments that ``llmc_fsm.oneshot`` does not have (``parameters``: the ones it has,
    by name; a mapping gives their values too, which ``pipeline="datafree"`` needs: it is taken only for a
    ``recipe`` none of whose modifiers reads calibration data, :func:`modifiers_reading_data`).

    Returns:
        The llmc-fsm arguments they set, e.g. ``{"tokenizer": processor}``; taken ones that set nothing are logged.

    Raises:
        TypeError: a name neither llmc-fsm nor llm-compressor's ``oneshot`` knows (with the closest llmc-fsm name).
        ValueError: llm-compressor arguments whose value llmc-fsm does not take: every one in one message, each
            with what to do (``pipeline="datafree"``: the modifiers that read calibration data, or that the recipe
            was not given to check; ``splits`` with a ``dataset`` that is one of llm-compressor's registered names:
            that name's refusal too).
        RecipeError: ``pipeline="datafree"`` with a recipe that cannot be read (as :func:`llmc_fsm.oneshot`).
    """
    unknown = [name for name in given if name not in LLMCOMPRESSOR_ARGS]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, [*parameters, *LLMCOMPRESSOR_ARGS], n=1, cutoff=0.6)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(f"oneshot() got unexpected keyword arguments: {', '.join(hints)}")
    refused, out = [], {}
    for name, value in given.items():
        rule = LLMCOMPRESSOR_ARGS[name]
        if rule.accept is not None and not any(_same(value, v) for v in rule.accept):
            taken = f" (accepted: {' or '.join(repr(v) for v in rule.accept)})" if rule.accept else ""
            note = (_splits_note(value, parameters) if name == "splits" else None) or rule.note
            refused.append(f"{name}={_short(value)}{taken}: {note}")
        elif name == "pipeline" and _same(value, "datafree") and (why := _datafree_refusal(parameters)) is not None:
            refused.append(f"{name}={_short(value)}: {why}")
        elif rule.rename is not None:
            out[rule.rename] = value
        else:
            logger.warning("llm-compressor argument %s=%s taken: %s", name, _short(value), rule.taken_line(value))
    if len(refused) == 1:
        raise ValueError(f"llm-compressor oneshot argument {refused[0]}")
    if refused:
        lines = "\n".join(f"  - {line}" for line in refused)
        raise ValueError(f"llm-compressor oneshot arguments llmc-fsm does not take as given:\n{lines}")
    return out


def modifiers_reading_data(recipe: Any) -> list[str]:
    """The class names of the modifiers of ``recipe`` (what ``llmc_fsm.oneshot`` takes; ``None``: its default
    recipe) that read calibration data (``calibration_data`` among their ``required_keys()``, as one-shot decides
    whether it reads data), once each in recipe order; stages already applied and training stages (which one-shot
    skips) are left out. Empty: a data-free recipe.

    Raises:
        RecipeError: the recipe cannot be read (:func:`~llmc_fsm.recipes.building.resolve_recipe`).
    """
    resolved = generated_recipe() if recipe is None else resolve_recipe(recipe)
    names = [
        type(modifier).__name__
        for stage, modifiers in resolved.plan()
        if stage.run_type != "train"
        for modifier in modifiers
        if "calibration_data" in modifier.required_keys()
    ]
    return list(dict.fromkeys(names))


def _datafree_refusal(parameters: Mapping[str, Any] | Sequence[str]) -> str | None:
    """Why ``pipeline="datafree"`` is refused for ``parameters`` (oneshot's arguments), or ``None`` (taken): llm-
    compressor's data-free pipeline calibrates nothing, which suits a recipe that reads no data only."""
    if not isinstance(parameters, Mapping) or "recipe" not in parameters:
        return "llmc-fsm takes 'datafree' only for a recipe it can check reads no data, and got none: leave it out"
    needs = modifiers_reading_data(parameters["recipe"])
    if not needs:
        return None
    which = f"{', '.join(needs)} {'reads' if len(needs) == 1 else 'read'}"
    return (
        f"{which} calibration data, which llm-compressor's 'datafree' pipeline does not give; leave pipeline out "
        "(llmc-fsm calibrates layer by layer) or use data-free modifiers only"
    )


def _splits_note(splits: Any, parameters: Mapping[str, Any] | Sequence[str]) -> str | None:
    """For ``splits`` given with a ``dataset`` that is one of llm-compressor's registered names: that name's
    refusal with the split in it (:func:`~llmc_fsm.data.rows.registered_name_error`), so one line names both (found
    by a tester: the ``splits`` refusal came first, and only without it was the name refused); else ``None``."""
    dataset = parameters.get("dataset") if isinstance(parameters, Mapping) else None
    why = registered_name_error(dataset, splits=splits) if isinstance(dataset, str) else None
    return None if why is None else f"the split of a dataset name llmc-fsm does not load; dataset {why}"


def _same(value: Any, accepted: Any) -> bool:
    """``value`` is ``accepted`` (``True`` is not ``1``, ``"sequential"`` is ``"sequential"``; a numpy scalar as its
    Python value: ``np.True_`` is ``True``, ``np.int64(1)`` is ``1``)."""
    value = value.item() if is_numpy_scalar(value) else value
    return type(value) is type(accepted) and value == accepted


def _short(value: Any) -> str:
    """``repr(value)`` on one line, at most 60 characters (a dataset or collator object is named by its type; a
    numpy scalar as its Python value)."""
    value = value.item() if is_numpy_scalar(value) else value
    plain = isinstance(value, str | bool | int | float | type(None)) or (
        isinstance(value, list | tuple) and all(isinstance(v, str | int | float) for v in value)
    )  # a list of class names (sequential_targets) was shown as <list> (found by a tester)
    text = repr(value) if plain else f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."
