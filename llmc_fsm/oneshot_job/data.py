"""Calibration and evaluation data of the one-shot job: text files read up front, token windows, generated text.

* :func:`read_text` — a text source read before the model loads (errors name the argument);
* :func:`eval_windows` — evaluation windows from the head of a text, as many as fit;
* :func:`check_seq_len` — a sequence length the model can take;
* :func:`generate_calibration` — calibration data sampled from the model itself
  from :data:`DEFAULT_PROMPTS` (the default, needs no dataset).
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from llmc_fsm.core.errors import MissingStateError
from llmc_fsm.core.modifier import overrides
from llmc_fsm.data.protocol import kept_tokenizer_state, load_text, token_windows
from llmc_fsm.data.rows import describe_rows, is_rows
from llmc_fsm.recipes.building import given_arguments
from llmc_fsm.session.session import Session
from llmc_fsm.toolkit.calibrated import nonfinite_weights
from llmc_fsm.toolkit.masks import zeros_structure
from llmc_fsm.toolkit.obs import HessianAccumulator
from llmc_fsm.toolkit.targets import check_not_quantized, compact_names, select_targets
from llmc_fsm.toolkit.views import weight_views

if TYPE_CHECKING:
    import torch
    from torch import nn


__all__ = [
    "DEFAULT_PROMPTS",
    "calibration_inputs",
    "check_modifiers",
    "check_seq_len",
    "describe",
    "eval_windows",
    "generate_calibration",
    "is_tensor",
    "read_text",
]

logger = logging.getLogger(__name__)

#: Prompts the model continues to make its own calibration data when no dataset is given.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "The history of the city begins",
    "In mathematics, a prime number is",
    "Here is a short story about a lighthouse keeper:",
    "def fibonacci(n):",
    "The committee published its annual report on",
    "Photosynthesis is the process by which",
    "Dear Sir or Madam, I am writing to",
    "The match ended in a draw after",
)


def torch_dtype_of(name: str, config: Any = None) -> Any:
    """The torch dtype of a ``dtype`` setting (:data:`llmc_fsm.oneshot_job.settings.DTYPES`); ``auto``: the one
    ``config`` (a model's config) names (``dtype``, or transformers 4's ``torch_dtype``), fp32 if none."""

    if name == "auto":
        # transformers 4's torch_dtype read from the instance: transformers 5's torch_dtype property warns
        # "`torch_dtype` is deprecated!" (on every in-memory run of a config without a dtype: found by a tester)
        named = getattr(config, "dtype", None) or getattr(config, "__dict__", {}).get("torch_dtype")
        name = str(named or "float32").removeprefix("torch.")
    return getattr(torch, name)


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.Tensor``."""

    return isinstance(value, torch.Tensor)


def check_seq_len(model: Any, seq_len: int, what: str = "sequence length {n} (--seq-len / eval)") -> None:
    """Refuse a sequence length above the ``max_position_embeddings`` of ``model`` (a model, or its config);
    ``what``: the length named in the message, ``{n}`` its value.

    Raises:
        ValueError: naming the length, where it comes from and the limit.
    """
    limit = getattr(getattr(model, "config", model), "max_position_embeddings", None)  # a model or its config
    if isinstance(limit, int) and seq_len > limit:
        msg = f"{what.format(n=seq_len)} is above the model's max_position_embeddings ({limit}); use at most {limit}"
        raise ValueError(msg)


def eval_windows(tokenizer: Any, text: str, num_windows: int, seq_len: int) -> Any:
    """``num_windows`` windows from the head of ``text``, or as many as fit (with a warning).

    Raises:
        ValueError: ``text`` is shorter than one window.
    """

    try:
        return token_windows(tokenizer, text, num_windows=num_windows, seq_len=seq_len)
    except ValueError:
        with kept_tokenizer_state(tokenizer):
            n_ids = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        fit = n_ids // seq_len
        if fit < 1:
            msg = (
                f"the eval text has {n_ids} tokens, fewer than one evaluation window of {seq_len}: pass a longer "
                "eval text (--eval-text) or shorter windows (--seq-len / eval_seq_length)"
            )
            raise ValueError(msg) from None
        logger.warning("the eval text has %d tokens (< %d x %d): using %d window(s)", n_ids, num_windows, seq_len, fit)
        return token_windows(tokenizer, text, num_windows=fit, seq_len=seq_len)


def calibration_overlap(evaluation: torch.Tensor, calibration: torch.Tensor) -> int:
    """How many of the evaluation tokens the calibration windows also hold, from the windows' token positions in the
    text they were both cut from (:func:`window_positions`): ``evaluation`` and ``calibration`` hold positions
    (any shape), not token ids. ``0`` when they share none.

    Positions, not contents: until 2026-12-07 the ids were compared, and an evaluation head that merely ended with the
    token the calibration tail began with (one `` of``) was counted as calibrated on (found by a tester)."""
    return int(torch.isin(evaluation.reshape(-1), calibration.reshape(-1)).sum())


def window_positions(
    tokenizer: Any, text: str, evaluation: torch.Tensor, calibration: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token positions in ``text`` of ``evaluation`` windows ``[E / L, L]`` cut from its head (:func:`eval_windows`)
    and ``calibration`` windows ``[C / L', L']`` cut from its tail (``token_windows(from_end=True)``): ``LongTensor``
    of their shapes, ``0 .. E - 1`` and ``T - C .. T - 1`` for a text of ``T`` tokens. A text of at least ``E + C``
    tokens counts as ``E + C`` (only its first ``E + C`` tokens are read: the windows are apart whatever its length).
    """
    e, c = evaluation.numel(), calibration.numel()
    try:
        token_windows(tokenizer, text, num_windows=1, seq_len=e + c)
        total = e + c
    except ValueError:  # fewer tokens than both windows hold: count them all (a short text)
        with kept_tokenizer_state(tokenizer):
            if getattr(tokenizer, "model_max_length", None) is not None:  # no "longer than the maximum" warning
                tokenizer.model_max_length = int(1e30)
            total = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    head = torch.arange(e).view(evaluation.shape)
    tail = torch.arange(total - c, total).view(calibration.shape)
    return head, tail


def generate_calibration(
    model: nn.Module,
    tokenizer: Any,
    *,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    prompts: tuple[str, ...] = DEFAULT_PROMPTS,
    progress: bool = True,
) -> torch.LongTensor:
    """Sample ``num_samples`` sequences of exactly ``seq_len`` tokens from the model itself.

    Each prompt of ``prompts`` is continued by ``ceil(num_samples / len(prompts))``
    samples (top-p 0.95, temperature 1, end-of-sequence suppressed), with the
    torch RNG seeded by ``seed`` inside a forked RNG state (the caller's RNG is
    untouched). Returns ``LongTensor[num_samples, seq_len]`` (prompt included).
    A progress bar (``progress``) counts the samples: minutes on a CPU went by
    without a line (a newcomer's case).
    """

    per_prompt = math.ceil(num_samples / len(prompts))
    rows: list[torch.Tensor] = []
    device = next(model.parameters()).device
    bar = tqdm(
        total=num_samples,
        desc="generating calibration samples (no dataset given)",
        unit="sample",
        disable=not progress,
        leave=False,
    )
    with bar, torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(seed)
        for prompt in prompts:
            if len(rows) >= num_samples:
                break
            with kept_tokenizer_state(tokenizer):
                ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
            new = max(seq_len - ids.shape[1], 1)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                top_p=0.95,
                top_k=0,
                temperature=1.0,
                max_new_tokens=new,
                min_new_tokens=new,
                num_return_sequences=min(per_prompt, num_samples - len(rows)),
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            )
            rows.extend(out[:, :seq_len].cpu())
            bar.update(out.shape[0])
    return torch.stack(rows[:num_samples]).long()


def read_text(role: str, source: Any) -> str:
    """``load_text(source)``; errors name ``role`` (the argument), and an empty text fails before the model loads.

    Raises:
        OSError / ValueError: from :func:`llmc_fsm.data.protocol.load_text`, prefixed with ``role``; empty text.
    """

    try:
        text = load_text(source)
    except (OSError, ValueError) as err:
        raise type(err)(f"{role}: {err}") from err
    if not text.strip():
        msg = f"{role}: {describe(source)} holds no text; pass a file with text in it (e.g. wikitext-2's wiki.test.raw)"
        raise ValueError(msg)
    return text


def describe(source: Any) -> str:
    """A short name for a data source (a path, ``<tensor (N, L)>``, ``list of 3 str``, ``datasets.Dataset``)."""
    if type(source).__name__ == "Tensor":
        return f"<tensor {tuple(source.shape)}>"
    if isinstance(source, str | os.PathLike):
        return os.fspath(source)
    return describe_rows(source) if is_rows(source) else type(source).__name__


def _stages_giving_the_schedule(session: Session) -> list[str]:
    """The stages of ``session``'s recipe whose own ``start``/``end`` a scheduled modifier inherits (the recipe gave
    the modifier none of start/end/update itself)."""
    names = []
    for stage in session.recipe.stages:
        if stage.start is None and stage.end is None:
            continue
        for modifier in stage.modifiers:
            given = given_arguments(modifier)
            if modifier.is_scheduled and given is not None and not given & {"start", "end", "update"}:
                names.append(stage.name)
                break
    return names


def check_modifiers(sessions: list[Session], model: Any, calibration_data: Any = True) -> None:
    """Before any measuring or compression: every session's required state, then every modifier's
    :meth:`~llmc_fsm.Modifier.check_model` (group sizes, targets, an already quantized model), and the
    ``check_stage(model, selected)`` of a modifier that has one (``selected``: ``(modifier, modules its check_model
    selected)`` for each modifier of its stage, in recipe order) (what it needs of the other modifiers of its stage:
    REAP's, that they follow the experts it drops), and the first ``check_recipe(model, [(label, modifier), ...])``
    over every modifier that has one, in recipe order (two KV-cache schemes for one attention); then the recipe as a
    whole: modules quantized twice or pruned
    after quantization, a ``preserve_sparsity_mask`` below an earlier sparsity, a rotation after a stage that prunes
    or quantizes, fused experts no quantizer covers, and a NaN/Inf in any weight a stage would change.

    Raises:
        MissingStateError: a modifier needs state one-shot does not give (``steps_per_epoch``...), named.
        ValueError: from a modifier's ``check_model``, or one of the recipe's checks; nothing was changed.
    """

    for session in sessions:
        missing = session.missing_state(model=model, calibration_data=calibration_data)
        if missing:  # e.g. steps_per_epoch: only a training loop gives it
            needs = "; ".join(f"{label} needs {', '.join(sorted(keys))}" for label, keys in missing.items())
            scheduled = [
                type(m).__name__
                for m in session.modifiers
                if m.is_scheduled and overrides(m, "on_calibration_end") and "steps_per_epoch" not in m.required_state
            ]
            msg = (
                f"{needs}, which one-shot does not give (it gives the model and the calibration data): such a "
                "modifier acts during training; put it in a stage with run_type: train, which one-shot skips, or "
                "run the recipe in a training loop (docs/training.md)"
            )
            if scheduled:  # a one-shot modifier given a schedule (SparseGPT with start: 0; found by a tester)
                names = ", ".join(dict.fromkeys(scheduled))
                stages = _stages_giving_the_schedule(session)
                on = ", ".join(repr(n) for n in stages)  # the stage's, which its modifiers inherit (blamed on them)
                where = f" (given on stage {on}: its modifiers inherit the stage's start/end)" if stages else ""
                advice = (
                    f"{names}: start/end/update are a training schedule counted in epochs (steps_per_epoch, which "
                    f"one-shot does not give){where}, and this modifier compresses once from calibration data: remove "
                    "them to run it in one-shot (llm-compressor's oneshot ignores them)"
                )
                msg = advice if len(scheduled) == len(missing) else f"{msg}; {advice}"
            raise MissingStateError(msg, lifecycle=session.lifecycle, missing=missing)
    quantized_by: dict[str, str] = {}  # module -> the quantizing modifier (and stage) that targets it
    pruned_to: dict[str, tuple[str, float]] = {}  # module -> (pruning modifier, its unstructured sparsity)
    changed: list[tuple[str, dict[str, Any]]] = []  # (modifier's label, the modules it changes), recipe order
    staged: dict[str, tuple[tuple[int, int], str, str]] = {}  # module -> (stage order, modifier, "prunes"/"quantizes")
    quantizers = [m for s in sessions for m in s.modifiers if hasattr(m, "experts_checked_by_run")]
    for modifier in quantizers:  # several: fused experts left dense are a question for the whole recipe (below)
        modifier.experts_checked_by_run = len(quantizers) > 1
    for number, session in enumerate(sessions):
        selected: list[tuple[Any, dict[str, Any]]] = []  # (modifier, what it would change), in recipe order
        for modifier in session.modifiers:
            try:
                targets = modifier.check_model(model)
            except ValueError as exc:
                name = type(modifier).__name__
                if str(exc).startswith(name):
                    raise
                raise ValueError(f"{name}: {exc}") from exc
            if is_tensor(calibration_data) and isinstance(targets, dict) and targets:
                _warn_few_tokens(modifier, targets, int(calibration_data.numel()))
            declared = not isinstance(targets, dict)
            if declared:
                targets = _declared_targets(modifier, model)
                if targets:  # e.g. magnitude pruning; ConstantPruning: a quantized checkpoint holds no weights
                    check_not_quantized(
                        model, type(modifier).__name__, "compress the original full-precision model instead"
                    )
            selected.append((modifier, targets))
            order = (number, _stage_position(session, modifier))  # stages keep their order when fused
            _check_rotation_order(modifier, session, order, staged)
            modules_changed = getattr(modifier, "modules_changed", None)
            if declared and callable(modules_changed):  # e.g. a rotation: its check_model returns its plan
                changed.append((_label(modifier, session), modules_changed(model)))
            if declared and not getattr(modifier, "adds_zeros", True):  # keeps existing zeros, makes none: not
                targets = {}  # refused after a quantizing modifier of the same recipe
            if targets:
                _check_quantized_once(modifier, session, targets, quantized_by)
                _check_mask_kept(modifier, session, targets, pruned_to)
                changed.append((_label(modifier, session), targets))
                _record_stage_change(modifier, session, order, targets, staged)
        for modifier in session.modifiers:  # what a modifier needs of the others in its stage (REAP's followers)
            check_stage = getattr(modifier, "check_stage", None)
            if callable(check_stage):
                check_stage(model, selected)
    checks_recipe = [
        (_label(m, s), m) for s in sessions for m in s.modifiers if callable(getattr(m, "check_recipe", None))
    ]
    if checks_recipe:  # what the modifiers need of each other across stages (one KV-cache scheme per attention)
        checks_recipe[0][1].check_recipe(model, checks_recipe)
    _check_experts_quantized(model, quantizers, quantized_by)
    _check_finite_weights(changed)


def _check_finite_weights(changed: list[tuple[str, dict[str, Any]]]) -> None:
    """Refuse, before any stage runs, a NaN/Inf weight that a modifier of any stage would change, naming the first
    such modifier in recipe order. Each modifier also checks the modules it compresses before changing them, but
    one-shot runs the stages one after another: a NaN that only a later stage compresses was found after the
    earlier stages had changed the model you passed (a tester's case). Weights on ``meta`` (a streamed run's
    skeleton) pass: the modifiers check each layer as it is loaded.

    Raises:
        ValueError: ``"<Modifier> of stage '<stage>': the weights of <modules> hold NaN or Inf values, so they cannot
            be compressed: ..."`` (the class name alone outside a stage), the modifier's own message.
    """
    seen: set[str] = set()
    for label, targets in changed:
        modules = {
            name: module
            for name, module in targets.items()
            if name not in seen and isinstance(getattr(module, "weight", None), torch.Tensor)
        }
        seen.update(modules)
        broken = nonfinite_weights(modules)
        if broken:
            msg = (
                f"{label}: the weights of {compact_names(broken)} hold NaN or Inf values, so they "
                "cannot be compressed: the checkpoint (or an earlier change to the model) is broken there"
            )
            raise ValueError(msg)


def _check_experts_quantized(model: Any, quantizers: list[Any], quantized_by: dict[str, str]) -> None:
    """With several quantizing modifiers (each told so: ``experts_checked_by_run``): refuse, with the first one's
    ``dense_experts_refusal``, fused experts that no modifier of the recipe quantizes (transformers would not reload
    them from the quantized checkpoint). One modifier quantizing the attention and another the experts runs (found
    by a tester: each was checked alone, and the first refused)."""
    refusals = [m.dense_experts_refusal for m in quantizers if m.experts_checked_by_run and m.dense_experts_refusal]
    if not refusals:
        return
    experts = [n for n, m in model.named_modules() if weight_views(m) and "" not in weight_views(m)]
    if any(not any(q.startswith(f"{n}.") for q in quantized_by) for n in experts):
        raise ValueError(refusals[0])


def _declared_targets(modifier: Any, model: Any) -> dict[str, Any]:
    """The modules a modifier whose ``check_model`` returns none would compress, from its ``targets`` / ``ignore``
    (``{}`` when it has none or they match nothing — the modifier reports that itself)."""

    patterns, ignore = getattr(modifier, "targets", None), getattr(modifier, "ignore", None)
    if not isinstance(patterns, list) or not isinstance(ignore, list):
        return {}
    try:
        return select_targets(model, patterns, ignore).selected  # no warnings: the modifier's own checks give them
    except ValueError:
        return {}


def _check_quantized_once(modifier: Any, session: Session, targets: dict[str, Any], seen: dict[str, str]) -> None:
    """Refuse a modifier, in recipe order, that compresses a module an earlier modifier of the recipe quantizes.

    Two quantizing modifiers would re-quantize the first one's grid; a pruning one would move quantized weights
    off their grid (its zeros then missing from the checkpoint's ``sparsity_config``). Unchecked, both failed only
    after the first stage's work, or with ``fuse_stages`` not at all. ``seen``: module -> the quantizing modifier.
    """
    label = _label(modifier, session)
    twice = sorted(name for name in targets if name in seen)
    quantizes = hasattr(modifier, "quantization_scheme")
    if twice and quantizes:
        msg = (
            f"{label} and {seen[twice[0]]} both quantize {len(twice)} modules, e.g. {twice[0]}; a module is "
            "quantized once: give the modifiers disjoint targets (or ignore)"
        )
        raise ValueError(msg)
    if twice and callable(getattr(modifier, "resolve", None)) and hasattr(modifier, "mappings"):  # smoothing
        msg = (
            f"{label} would smooth {len(twice)} modules that {seen[twice[0]]} quantizes before it, e.g. "
            f"{twice[0]}; smoothing a quantized weight moves it off its grid: put the smoothing modifier in or "
            "before that quantizer's stage, or leave those modules out of it (its ignore, e.g. 're:.*mlp.*', or "
            "mappings naming only the others)"
        )
        raise ValueError(msg)
    if twice:
        msg = (
            f"{label} would compress {len(twice)} modules that {seen[twice[0]]} quantizes before it, e.g. "
            f"{twice[0]}; prune first, then quantize: put the sparsity stage (or modifier) before the quantization "
            "one in the recipe"
        )
        raise ValueError(msg)
    if quantizes:
        seen.update(dict.fromkeys(targets, label))


def _label(modifier: Any, session: Session) -> str:
    """``SparseGPTModifier of stage 'sparsity_stage'`` (the class name alone outside a stage)."""
    stage = next((st.name for st in session.recipe.stages if any(m is modifier for m in st.modifiers)), None)
    return f"{type(modifier).__name__} of stage {stage!r}" if stage is not None else type(modifier).__name__


def _check_mask_kept(
    modifier: Any, session: Session, targets: dict[str, Any], pruned_to: dict[str, tuple[str, float]]
) -> None:
    """Refuse, before any work, a pruning modifier with ``preserve_sparsity_mask`` whose unstructured sparsity is
    below what an earlier pruning modifier of the recipe prunes in the same modules: it keeps every earlier zero, so
    it could not reach its own sparsity (it failed after the earlier stage's work, as llm-compressor does: a
    tester's case). ``pruned_to``: module -> (earlier modifier, its sparsity), updated here."""
    sparsity = getattr(modifier, "sparsity", None)
    structure = getattr(modifier, "mask_structure", None)
    zeros = zeros_structure(structure) if isinstance(structure, str) else None
    count, group = (int(part) for part in zeros.split(":")) if zeros is not None else (0, 0)
    if group:  # N:M ("0:0" is unstructured): the structure's fraction is what it prunes, keeping no earlier mask
        pruned_to.update(dict.fromkeys(targets, (_label(modifier, session), count / group)))
        return
    if not isinstance(sparsity, float):
        return
    if getattr(modifier, "preserve_sparsity_mask", False):
        denser = sorted(name for name in targets if name in pruned_to and pruned_to[name][1] > sparsity)
        if denser:
            label, earlier = pruned_to[denser[0]]
            msg = (
                f"{_label(modifier, session)} keeps every zero with preserve_sparsity_mask, but {label} prunes "
                f"{len(denser)} of its targets to sparsity {earlier} before it, above its own {sparsity} (e.g. "
                f"{denser[0]}): give it a sparsity of at least {earlier}, or preserve_sparsity_mask: false"
            )
            raise ValueError(msg)
    pruned_to.update(dict.fromkeys(targets, (_label(modifier, session), sparsity)))


def _stage_position(session: Session, modifier: Any) -> int:
    """The index of ``modifier``'s stage in ``session``'s recipe (a fused session holds every stage), 0 outside one."""
    return next((i for i, st in enumerate(session.recipe.stages) if any(m is modifier for m in st.modifiers)), 0)


def _record_stage_change(
    modifier: Any,
    session: Session,
    order: tuple[int, int],
    targets: dict[str, Any],
    staged: dict[str, tuple[tuple[int, int], str, str]],
) -> None:
    """Note, for :func:`_check_rotation_order`, the modules a pruning or quantizing ``modifier`` of the stage at
    ``order`` changes (the first such stage per module)."""
    if hasattr(modifier, "quantization_scheme"):
        verb = "quantizes"
    elif getattr(modifier, "adds_zeros", True) and (
        hasattr(modifier, "sparsity") or hasattr(modifier, "mask_structure")
    ):
        verb = "prunes"
    else:
        return
    for name in targets:
        staged.setdefault(name, (order, _label(modifier, session), verb))


def _check_rotation_order(
    modifier: Any, session: Session, order: tuple[int, int], staged: dict[str, tuple[tuple[int, int], str, str]]
) -> None:
    """Refuse, before any work, a modifier that mixes the weights' channels (``keeps_zeros = False``: a rotation)
    after a stage that prunes or quantizes them (``staged``, see :func:`_record_stage_change`): it would fill the
    pruned zeros while the saved recipe marks the pruning applied, or move quantized weights off their grid (refused
    only at its initialize, after the earlier stage's work). In one stage the rotation runs at initialize, before the
    stage's pruning or quantization; with ``fuse_stages`` the stages keep their recipe order for this check (found
    by testers)."""
    if getattr(modifier, "keeps_zeros", True):
        return
    earlier = sorted((name, label, verb) for name, (at, label, verb) in staged.items() if at < order)
    if not earlier:
        return
    name, label, verb = earlier[0]
    if verb == "prunes":
        msg = (
            f"{_label(modifier, session)} mixes the weights' channels, which fills the zeros {label} prunes before "
            f"it (e.g. in {name}): put the pruning after it (a stage after the rotation, before or with the "
            "quantization), or leave one of them out"
        )
    else:
        msg = (
            f"{_label(modifier, session)} mixes the weights' channels, which moves the weights {label} quantizes "
            f"before it off their grid (e.g. {name}): rotations go before quantization: put it in the first stage"
        )
    raise ValueError(msg)


def _warn_few_tokens(modifier: Any, targets: dict[str, Any], tokens: int) -> None:
    """Warn when a Hessian-based modifier (one whose accumulator keeps the full Hessian) gets fewer calibration
    tokens than a target has inputs."""

    new_accumulator = getattr(modifier, "_new_accumulator", None)
    if new_accumulator is None or not all(hasattr(m, "weight") for m in targets.values()):
        return
    widest = max(targets, key=lambda name: int(targets[name].weight.shape[-1]))
    width = int(targets[widest].weight.shape[-1])
    if not tokens or tokens >= width:
        return
    accumulator = new_accumulator(targets[widest])
    full = not getattr(accumulator, "diagonal_only", True) and getattr(accumulator, "keep_hessian", True)
    if isinstance(accumulator, HessianAccumulator) and full:  # a diagonal or input ranges alone are not rank-deficient
        logger.warning(
            "%s: %d calibration tokens for up to %d inputs (%s): the Hessians are rank-deficient and the result "
            "depends on float rounding (batch size, threads); give at least %d tokens (--num-samples x --seq-len)",
            type(modifier).__name__,
            tokens,
            width,
            widest,
            width,
        )


def calibration_inputs(session: Session, windows: Any) -> Any:
    """``windows`` when a modifier of ``session`` requires ``calibration_data``, else none of them (``windows[:0]``).

    A session of data-free modifiers (round-to-nearest quantization) then compresses every
    target at once, with no calibration forwards, even when a dataset was given for other stages.
    """
    return windows if session.requires("calibration_data") else windows[:0]
