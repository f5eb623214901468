"""SmoothQuant and logarithmic equalization: move activation outliers into the weights before quantization.

SmoothQuant (Xiao et al., arXiv 2211.10438, Sec. 3-4): for each mapping (a smooth layer and the Linears that
read its output, :mod:`llmc_fsm_quantization.mappings`) and each channel ``j`` of that output,

    ``s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)``

where ``max|X_j|`` is over every calibration token and ``max|W_j|`` over column ``j`` of every balance layer;
``alpha`` is ``smoothing_strength``. The smooth layer's output channel ``j`` is divided by ``s_j`` and the balance
layers' column ``j`` multiplied by it (:func:`~llmc_fsm_quantization.mappings.fold_scales`): the float model is
unchanged, and the migrated activations' ``max|X'_j| = max|X_j| / s_j`` are flatter, so per-tensor / per-token
int8 activations lose less. ``LogarithmicEqualizationModifier`` uses ``s_j = max|X_j| / log2(2 + max|X_j|)``
(no weight term). A channel whose activation or weight maximum is 0 keeps ``s_j = 1``.

Smoothing runs decoder layer by decoder layer inside the sequential pipeline: before the pipeline calibrates a
layer for the other modifiers of the stage (GPTQ, RTN), it calls :meth:`SmoothingModifier.prepare_layer`, which
runs the calibration inputs through the layer once (with the other modifiers' hooks suspended), computes the
scales and folds them. So a quantizer in the same stage sees the smoothed activations and weights, as it
would in a later stage. Under ``torch.distributed`` (``torchrun``) each rank observes its share of the calibration
windows and the per-channel statistics are combined over the ranks before the scales are computed
(:meth:`ActivationObserver.all_reduce`), so every rank folds the scales of one process. Defaults: the norm mappings
(``input_layernorm -> q/k/v``, ``post_attention_layernorm -> gate/up``), the inputs of the attention and MLP
projections (paper Sec. 4).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from llmc_fsm import Modifier, find_decoder_layers
from llmc_fsm.toolkit import (
    LinearView,
    all_reduce_tensor,
    check_not_quantized,
    compact_names,
    is_distributed,
    nonfinite_weights,
    observe_inputs,
    patterns,
    weight_views,
)
from llmc_fsm_quantization.mappings import (
    ResolvedMapping,
    describe_mappings,
    fold_scales,
    mappings_to_smoothquant_recipe,
    parse_mappings,
    resolve_mappings,
)

__all__ = [
    "FOLD_TOLERANCE",
    "PROBE_LIMIT",
    "LogarithmicEqualizationModifier",
    "SmoothQuantModifier",
    "SmoothingModifier",
    "fold_change",
    "logarithmic_scales",
    "smoothquant_scales",
]

logger = logging.getLogger(__name__)

#: torch's private per-module dictionaries of forward hooks, swapped out while a smoothing pass runs.
_FORWARD_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


@contextlib.contextmanager
def suspended_forward_hooks(root: nn.Module) -> Iterator[None]:
    """Run forwards of ``root`` without the forward hooks already registered on it or its submodules.

    The smoothing pass of a decoder layer must not feed the other modifiers' statistics (their hooks
    were registered at ``calibration_start`` and expect the smoothed layer). Hooks registered inside the
    block go to fresh dictionaries, which the block must have emptied (remove their handles) before it ends.
    The views of fused expert matrices inside ``root`` (:func:`~llmc_fsm.toolkit.views.weight_views`; not
    submodules) are covered too, and their ``routed_tokens`` counts are put back as they were.
    """
    saved = []
    views = [v for module in root.modules() for v in weight_views(module).values()]
    counts = [v.routed_tokens for v in views]
    for module in [*root.modules(), *views]:
        for attr in _FORWARD_HOOK_DICTS:
            if hasattr(module, attr):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, OrderedDict())
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
        for view, count in zip(views, counts, strict=True):
            view.routed_tokens = count


def members(layer: nn.Module) -> set[int]:
    """``id`` of every module of ``layer`` and of every view of a fused expert matrix in it."""
    return {id(m) for module in layer.modules() for m in (module, *weight_views(module).values())}


def block_output(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """What ``block`` computes on ``(args, kwargs)``: its forward's (first) output; for the view of one expert
    matrix (:class:`~llmc_fsm.toolkit.views.LinearView`, whose call returns its input), ``x W^T``."""
    if isinstance(block, LinearView):
        x = args[0]
        return torch.nn.functional.linear(x, block.weight.to(x.dtype))
    out = block(*args, **kwargs)
    return out[0] if isinstance(out, tuple | list) else out


def smoothquant_scales(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's ``s_j = act_max_j ** alpha / weight_max_j ** (1 - alpha)`` (arXiv 2211.10438, Eq. 4).

    Args:
        act_max: ``[C]`` float32, ``max|X_j|`` over the calibration tokens.
        weight_max: ``[C]`` float32, ``max|W_ij|`` over the balance layers' rows.
        alpha: migration strength in ``[0, 1]``.

    Returns:
        ``[C]`` float32; 1 where ``act_max`` or ``weight_max`` is 0.
    """
    ok = (act_max > 0) & (weight_max > 0)
    s = act_max.clamp_min(1e-30).pow(alpha) / weight_max.clamp_min(1e-30).pow(1.0 - alpha)
    return torch.where(ok, s, torch.ones_like(s))


def logarithmic_scales(act_max: torch.Tensor) -> torch.Tensor:
    """Logarithmic equalization's ``s_j = act_max_j / log2(2 + act_max_j)`` (``[C]`` float32; 1 where 0)."""
    s = act_max / torch.log2(2.0 + act_max)
    return torch.where(act_max > 0, s, torch.ones_like(s))


def _ignore_or_none(value: Any) -> list[str]:
    """:func:`~llmc_fsm.toolkit.patterns`, ``None`` read as ``[]``: llm-compressor's SmoothQuant declares ``ignore:
    list[str] | None = None`` (no module ignored)."""
    return [] if value is None else patterns(value)


def _strength(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A finite number; outside SmoothQuant's [0, 1] (paper Sec. 4.2) it runs with a warning, as llm-compressor 0.14
    takes any float (it was refused: a tester's recipe that llm-compressor runs)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        msg = f"smoothing_strength must be a finite number (SmoothQuant's alpha, usually in [0, 1]), got {value!r}"
        raise ValueError(msg)
    if not 0.0 <= float(value) <= 1.0:
        logger.warning(
            "smoothing_strength %r is outside SmoothQuant's [0, 1]: the scales max|X_j|^alpha / max|W_j|^(1-alpha) "
            "then move more than the whole activation range into the weights (or the other way); it runs, as in "
            "llm-compressor",
            value,
        )


def _mappings_field(value: Any) -> list[list[Any]] | None:
    """Either recipe form -> SmoothQuant's ``[[balance patterns...], smooth pattern]`` (what recipe.yaml keeps:
    llm-compressor 0.14's SmoothQuantModifier refuses AWQ's dict form; until session 40 that form was saved)."""
    return mappings_to_smoothquant_recipe(parse_mappings(value))


#: Model classes whose llm-compressor 0.14 default SmoothQuant mappings smooth ``input_layernorm`` -> the attention's
#: input projections only (its Mixtral, Qwen-MoE and DeepSeek-V2 entries: MoE families, MLP smoothing left out).
LLMCOMPRESSOR_ATTENTION_ONLY = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "Ernie4_5_MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "GlmMoeDsaForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
    }
)

#: llm-compressor's ``SmoothQuantModifier(algorithm=...)`` values: its replacement for LogarithmicEqualizationModifier
#: (which it deprecates) and what its saved recipe.yaml records.
ALGORITHMS = ("smoothquant", "log_equalization")


def _algorithm(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in ALGORITHMS:
        msg = f"algorithm must be smoothquant or log_equalization (llm-compressor's values), got {value!r}"
        raise ValueError(msg)
    if isinstance(instance, LogarithmicEqualizationModifier) and value != "log_equalization":
        msg = f"LogarithmicEqualizationModifier is algorithm log_equalization, got {value!r}; use SmoothQuantModifier"
        raise ValueError(msg)


def _steps(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        msg = (
            f"{attribute.name} is not supported: smoothing uses every calibration sample "
            "(--num-samples sets how many); leave it out"
        )
        raise ValueError(msg)


def _calibration_function(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        msg = (
            f"calibration_function must be null, got {value!r}: a recipe cannot carry a callable, and smoothing runs "
            "the decoder layers' own forward; leave it out"
        )
        raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class SmoothingModifier(Modifier):
    """Base of the smoothing modifiers (not registered itself): mappings, the per-layer pass, folding.

    Args:
        mappings: llm-compressor's ``mappings`` (either form, :func:`~llmc_fsm_quantization.mappings.parse_mappings`),
            held and saved in SmoothQuant's ``[[balance patterns...], smooth pattern]``; default (``None``): derived
            from the model's decoder layers.
        ignore: module patterns; a mapping whose smooth layer or every balance layer is ignored is not smoothed
            (an ignored balance layer of another mapping absorbs the scale in its float weights).

    Subclasses implement :meth:`_smooth_layer_mappings`. After the run, :attr:`smoothing_results` holds, per smooth
    layer name, the statistics of what was folded.
    """

    required_state = frozenset({"model", "calibration_data"})
    #: whether the default mappings include ``v_proj -> o_proj`` and ``up_proj -> down_proj``.
    include_linear_mappings: ClassVar[bool] = False
    #: whether a recipe mapping that fits no layer only as llm-compressor's AWQ skips it (``v_proj -> o_proj`` under
    #: grouped-query attention) is skipped with a warning rather than refused (:func:`resolve_mappings`).
    skip_incompatible_mappings: ClassVar[bool] = False

    mappings: list[list[Any]] | None = attrs.field(default=None, converter=_mappings_field)
    ignore: list[str] = attrs.field(factory=list, converter=_ignore_or_none)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._mappings: list[ResolvedMapping] = []
        self._done: set[str] = set()
        self._fold_checked: set[tuple[Any, ...]] = set()  # layer classes and mappings whose folds were checked
        self._warned: set[str] = set()  # mapping skip warnings given (each check and initialize resolves again)
        #: (a weak reference to a model on meta, the outcome of its fold check: :meth:`_probe_folds`)
        self._probe: tuple[weakref.ref[nn.Module], str | ValueError | None] | None = None
        self._layers: list[nn.Module] = []  # the model's decoder layers (initialize)
        self._compressed: dict[str, Any] = {}  # name -> module (or view) a modifier of the session compresses
        #: smooth layer name -> statistics of the scales folded into it (see the subclasses).
        self.smoothing_results: dict[str, dict[str, Any]] = {}
        #: smooth layer name -> the ``[C]`` float32 scales folded into it (none where nothing was folded).
        self.smoothing_scales: dict[str, torch.Tensor] = {}

    # ---- checks ----------------------------------------------------------------
    def resolve(self, model: nn.Module) -> list[ResolvedMapping]:
        """The mappings this modifier smooths in ``model`` (pure; see :func:`resolve_mappings`).

        Raises:
            ValueError: no mapping fits (naming the architecture and the modules), or a recipe mapping fits nothing.
        """
        return resolve_mappings(
            model,
            parse_mappings(self.mappings),
            owner=type(self).__name__,
            ignore=self.ignore,
            include_linear=self.include_linear_mappings,
            warned=self._warned,
            skip_incompatible=self.skip_incompatible_mappings,
        )

    def check_model(self, model: nn.Module) -> dict[str, nn.Module]:
        """The modules smoothing changes (smooth and balance layers), after :meth:`resolve`; pure.

        Raises:
            ValueError: as :meth:`resolve`, or the model is already quantized (smoothing a quantized
                weight would move it off its grid).
        """
        check_not_quantized(
            model, type(self).__name__, "smooth the original full-precision model, before quantizing it"
        )
        modules = _modules_of(self.resolve(model))
        quantized = [name for name, module in modules.items() if hasattr(module, "quantization_scheme")]
        if quantized:
            msg = (
                f"{type(self).__name__}: {len(quantized)} of the modules it would smooth are already quantized, e.g. "
                f"{quantized[0]}; smooth the original full-precision model, before quantizing it (put the smoothing "
                "modifier before the quantizing one)"
            )
            raise ValueError(msg)
        return modules

    @property
    def resolved_targets(self) -> dict[str, nn.Module]:
        return _modules_of(self._mappings)

    @property
    def resolved_mappings(self) -> list[ResolvedMapping]:
        """The mappings resolved at initialize (empty before)."""
        return list(self._mappings)

    def describe_mappings(self) -> list[str]:
        """One line per kind of resolved mapping (for ``explain`` and logs)."""
        return describe_mappings(self._mappings)

    def explain_model(self, model: nn.Module, stage: Sequence[Any] = ()) -> list[str]:
        """The mappings :meth:`resolve` finds in ``model``, one line per kind (``llmc-fsm explain --model``; ``stage``,
        the modifiers of its stage, is for subclasses: AWQ's), and, for a model on ``meta``, a line on the fold check
        (:meth:`check_stage`: run on random weights, or why it runs only in one-shot); pure.

        Raises:
            ValueError: as :meth:`resolve`.
        """
        lines = [f"mapping {line}" for line in describe_mappings(self.resolve(model))]
        if _all_meta(model):
            try:
                outcome = self._probe_folds(model)
            except ValueError as exc:  # check_stage's refusal, which explain prints as oneshot's
                outcome = f"refused by one-shot: {exc}"
            if outcome is not None:
                lines.append(f"fold check: {outcome}")
        return lines

    def check_stage(self, model: nn.Module, selected: list[tuple[Any, dict[str, Any]]]) -> None:
        """Before any work, for a model whose parameters are all on ``meta`` (what ``llmc-fsm explain --model`` checks,
        and one-shot from a model directory before it reads a weight): the fold check :meth:`prepare_layer` runs,
        on a CPU copy of the first decoder layer of each class with deterministic random weights and inputs
        (explain approved mappings one-shot then refused, found by a tester: Gemma 2's
        ``post_attention_layernorm -> gate_proj, up_proj``, whose MLP reads ``pre_feedforward_layernorm``). A model
        with weights is checked by :meth:`prepare_layer` on its calibration inputs. Where the layer is larger than
        :data:`PROBE_LIMIT` parameters or its forward cannot run on stand-in inputs, nothing is refused here
        (:meth:`explain_model` says the check runs only in one-shot).

        Raises:
            ValueError: folding test scales changes what a layer computes (the message one-shot gives).
        """
        if _all_meta(model):
            self._probe_folds(model)

    def _probe_folds(self, model: nn.Module) -> str | None:
        """:meth:`_check_folds` on a CPU copy of meta ``model``'s first decoder layer of each class (see
        :meth:`check_stage`), once per model: the line :meth:`explain_model` shows, ``None`` without mappings.

        Raises:
            ValueError: as :meth:`_check_folds`.
        """
        if self._probe is not None and self._probe[0]() is model:
            outcome = self._probe[1]
        else:
            try:
                outcome = self._run_probe(model)
            except ValueError as exc:  # the fold check's refusal: kept for the next call on this model
                outcome = exc
            self._probe = (weakref.ref(model), outcome)
        if isinstance(outcome, ValueError):
            raise ValueError(str(outcome))
        return outcome

    def _run_probe(self, model: nn.Module) -> str | None:
        found = _decoder_layers(model)
        mappings = self.resolve(model)
        if found is None or not mappings:
            return None
        firsts: dict[tuple[Any, ...], int] = {}
        for index, layer in enumerate(found):
            inside = members(layer)
            todo = [m for m in mappings if id(m.smooth) in inside]
            if todo:
                firsts.setdefault(_mapping_shape(layer, todo), index)
        indices = sorted(set(firsts.values()))
        size = max(sum(p.numel() for p in found[i].parameters()) for i in indices)
        only = "it runs in one-shot, on the first decoder layer of each class with the calibration inputs"
        if size > PROBE_LIMIT:
            return f"not run here ({size} parameters in a decoder layer, above {PROBE_LIMIT}): {only}"
        probe = copy.deepcopy(model)
        layers = _decoder_layers(probe)
        if layers is None:  # a copy of a model that has them
            return None
        generator = torch.Generator().manual_seed(0)
        try:
            _materialize_outside_layers(probe, layers, generator)
            for i in indices:
                _materialize(layers[i], generator)
            resolved = self.resolve(probe)
            width = probe.get_input_embeddings().embedding_dim
            dtype = next(layers[indices[0]].parameters()).dtype
            hidden = torch.randn(1, 16, width, generator=generator).to(dtype)
            checked = []
            for i in indices:
                batch = _probe_inputs(probe, layers, i, hidden)
                inside = members(layers[i])
                todo = [m for m in resolved if id(m.smooth) in inside]
                change = fold_change(layers[i], batch, todo)
                if not math.isfinite(change):
                    return f"not run here (layer {i}'s output on stand-in weights is not finite): {only}"
                self._check_folds(layers[i], batch, todo)
                checked.append(f"{i} ({type(layers[i]).__name__})")
        except ValueError as exc:
            if str(exc).startswith(f"{type(self).__name__}: folding"):
                raise
            return f"not run here ({_unbuilt(exc)}): {only}"
        except (RuntimeError, TypeError, AttributeError, IndexError, KeyError, NotImplementedError) as exc:
            return f"not run here ({_unbuilt(exc)}): {only}"
        return (
            f"passes on decoder layer {', '.join(checked)} with deterministic random weights and inputs (one-shot "
            "checks it again on the calibration inputs)"
        )

    # ---- lifecycle -------------------------------------------------------------
    def on_initialize(self, state: Any) -> None:
        self.check_model(state.model)
        self._mappings = self.resolve(state.model)
        self._done = set()
        self._fold_checked = set()
        found = _decoder_layers(state.model)
        self._layers = list(found) if found is not None else []
        self.smoothing_results = {}
        self.smoothing_scales = {}
        for line in self.describe_mappings():
            logger.info("%s mapping: %s", type(self).__name__, line)

    def on_calibration_start(self, state: Any) -> None:
        """Note the modules the session's modifiers compress (their ``resolved_targets``; AWQ's own quantizer's
        too; one-shot runs each stage as its own session, so a later stage's targets are not among them unless the
        stages are fused), whose weights :meth:`prepare_layer` checks with the mappings' (under
        ``torch.distributed`` each rank smooths from the statistics of every rank's calibration tokens, see
        :meth:`ActivationObserver.all_reduce`)."""
        binding = self._binding
        session = binding.session() if binding is not None else None
        modifiers = session.modifiers if session is not None else [self]
        self._compressed = {
            name: module for m in modifiers for name, module in getattr(m, "resolved_targets", {}).items()
        }

    def on_sequential_epoch_end(self, state: Any, modules: Any) -> None:
        """Nothing: smoothing happened in :meth:`prepare_layer` (a one-shot ``--resume`` restores what it did
        in the saved layers through :meth:`progress_state` / :meth:`restore_progress_state`)."""

    # ---- resume ----------------------------------------------------------------
    def _mappings_in(self, layer: nn.Module) -> list[ResolvedMapping]:
        inside = members(layer)
        return [m for m in self._mappings if id(m.smooth) in inside]

    def progress_state(self, layer: nn.Module) -> dict[str, Any]:
        """What this modifier did in decoder ``layer``, as JSON values, for a one-shot run's per-layer progress
        (:mod:`llmc_fsm.oneshot_job.resume`): the smoothed mappings, their :attr:`smoothing_results` and their
        :attr:`smoothing_scales` (float32 values, exact as JSON numbers)."""
        names = [m.smooth_name for m in self._mappings_in(layer) if m.smooth_name in self._done]
        return {
            "done": names,
            "results": {n: self.smoothing_results[n] for n in names if n in self.smoothing_results},
            "scales": {n: self.smoothing_scales[n].tolist() for n in names if n in self.smoothing_scales},
        }

    def restore_progress_state(self, layer: nn.Module, state: dict[str, Any]) -> None:
        """Take back :meth:`progress_state` of decoder ``layer`` (its weights come from the saved layer).

        Raises:
            ValueError: the state names a mapping this modifier did not resolve in ``layer`` (another model).
        """
        known = {m.smooth_name for m in self._mappings_in(layer)}
        unknown = [n for n in state["done"] if n not in known]
        if unknown:
            msg = f"{type(self).__name__}: saved progress names {unknown[0]}, not a mapping of this decoder layer"
            raise ValueError(msg)
        self._done.update(state["done"])
        self.smoothing_results.update(state["results"])
        self.smoothing_scales.update({n: torch.tensor(v, dtype=torch.float32) for n, v in state["scales"].items()})

    def on_calibration_end(self, state: Any) -> None:
        left = [m.smooth_name for m in self._mappings if m.smooth_name not in self._done]
        if left:
            msg = (
                f"{type(self).__name__}: {len(left)} of {len(self._mappings)} mappings were not smoothed, e.g. "
                f"{left[0]}: smoothing runs in the sequential pipeline (llmc_fsm.oneshot or "
                "llmc_fsm.pipeline.sequential.run_sequential), which calls prepare_layer before each decoder layer"
            )
            raise ValueError(msg)

    def on_finalize(self, state: Any) -> None:
        self._mappings = []

    # ---- the per-layer pass ----------------------------------------------------
    @torch.no_grad()
    def prepare_layer(self, layer: nn.Module, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        """Smooth the mappings inside decoder ``layer`` from its calibration ``inputs`` (before any other
        modifier calibrates it); the pipeline calls it once per layer.

        Args:
            layer: a decoder layer.
            inputs: per batch, the layer's ``(args, kwargs)`` (hidden states first).

        Raises:
            ValueError: a norm mapping's balance layers do not read the norm's output in this layer's forward
                (the default mappings' names did not describe the data flow), or, in the first layer of each class
                with each set of mappings (names within the layer), folding test scales into the mappings changes
                what the layer computes (:func:`fold_change`: the
                smooth layer's output is also read by something that is not a balance layer, e.g. a parallel MLP or
                the residual); checked before anything changes.
        """
        todo = self._todo_in(layer)
        if not todo or not inputs:
            return
        broken = nonfinite_weights({**_modules_of(todo), **self._compressed_in(layer)})
        if broken:  # before this layer changes (the quantizer's own check came after the smoothing had folded)
            msg = (
                f"{type(self).__name__}: the weights of {compact_names(broken)} hold NaN or Inf values, so their "
                "layer cannot be smoothed: the checkpoint (or an earlier change to the model) is broken there"
            )
            raise ValueError(msg)
        first = not self._fold_checked
        self._check_layer_folds(layer, inputs[0], todo)
        if first:  # before the first change: every other layer of this class in memory too, on these inputs
            device = inputs[0][0][0].device
            for other in self._layers:
                if type(other) is type(layer) and other is not layer and _held_on(other, device):
                    self._check_layer_folds(other, inputs[0], self._todo_in(other))
        self._smooth_layer_mappings(layer, inputs, todo)
        self._done.update(m.smooth_name for m in todo)

    def _compressed_in(self, layer: nn.Module) -> dict[str, nn.Module]:
        """The modules (and fused experts' matrices) of decoder ``layer`` that a modifier of the session compresses,
        by full name: a NaN weight outside every mapping (an o_proj whose mapping is skipped, an expert's down_proj)
        was found by the quantizer only after the layer had been smoothed (testers' cases); one nobody compresses
        is left to the model, as the quantizers leave it."""
        inside = {id(m) for m in layer.modules()}
        return {n: m for n, m in self._compressed.items() if id(getattr(m, "source", m)) in inside}

    def _todo_in(self, layer: nn.Module) -> list[ResolvedMapping]:
        """The mappings inside ``layer`` not smoothed yet."""
        return [m for m in self._mappings_in(layer) if m.smooth_name not in self._done]

    def _check_layer_folds(
        self, layer: nn.Module, batch: tuple[tuple[Any, ...], dict[str, Any]], todo: list[ResolvedMapping]
    ) -> None:
        """:meth:`_check_folds` on ``todo`` (``layer``'s mappings not smoothed yet), once per layer class and set of
        mappings (by names within the layer)."""
        shape = _mapping_shape(layer, todo)
        if todo and shape not in self._fold_checked:
            self._check_folds(layer, batch, todo)
            self._fold_checked.add(shape)

    def _check_folds(
        self, layer: nn.Module, batch: tuple[tuple[Any, ...], dict[str, Any]], todo: list[ResolvedMapping]
    ) -> None:
        """Refuse mappings whose fold would change the float model (:func:`fold_change` above
        :data:`FOLD_TOLERANCE`): all of ``todo`` at once, then, if that changes the layer, each alone to name them."""
        if fold_change(layer, batch, todo) <= FOLD_TOLERANCE:
            return
        changes = {m.smooth_name: fold_change(layer, batch, [m]) for m in todo}
        bad = [m for m in todo if changes[m.smooth_name] > FOLD_TOLERANCE]
        listed = "; ".join(
            f"{m.smooth_name} -> {_some(m.balance_names)} (relative change {changes[m.smooth_name]:.2g})"
            for m in (bad or todo)
        )
        together = "" if bad else " (each alone keeps it; together they do not)"
        changed = (
            "Nothing was changed in this layer (the decoder layers before it were smoothed already: start again from "
            "the original model)"
            if self._done
            else "Nothing was changed"
        )
        msg = (
            f"{type(self).__name__}: folding smoothing scales into {listed}{together} changes what "
            f"{type(layer).__name__} computes: the smooth layer's output is also read by something that is not one "
            "of its balance layers (a parallel MLP, the residual); give mappings whose balance layers are every "
            f"module reading it, or leave that layer out of the mappings. {changed}"
        )
        raise ValueError(msg)

    def _smooth_layer_mappings(
        self, layer: nn.Module, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]], todo: list[ResolvedMapping]
    ) -> None:
        raise NotImplementedError


#: :func:`fold_change` above which folding scales is taken to change the float function. It is computed in float32
#: whatever the model's dtype, and an exact fold changes a layer's update by at most 6.5e-7 relative (SmoothQuant's
#: default mappings on the 40 tiny families of ``tests/tiny_families.py`` that have some, every layer, 2026-12-07);
#: a fold whose smooth layer's output is read elsewhere (a parallel MLP, the residual) by ~0.1-1 with the test scales,
#: and one whose mapping leaves out one of the norm's readers (``input_layernorm -> [q_proj, v_proj]`` without
#: ``k_proj``) by ~1e-2, which 0.02 let through on a tiny Llama (found by a tester).
FOLD_TOLERANCE = 1e-3


#: Parameters of a decoder layer up to which the fold check runs on a model on ``meta`` (``llmc-fsm explain --model``,
#: one-shot's checks before it reads a weight: :meth:`SmoothingModifier.check_stage`): a CPU copy of the layer takes
#: its dtype's bytes each, and ``fold_change`` 4 more (float32), at most ~1 GiB at the limit (a Llama-3.2-3B layer
#: has 101M; a Llama-3-8B one 218M, above it).
PROBE_LIMIT = 2**27


class _Captured(Exception):
    """Raised by the probe's stand-in for a decoder layer once it has the layer's inputs."""


def _all_meta(model: nn.Module) -> bool:
    """Whether ``model`` has parameters and every one is on ``meta`` (``llmc-fsm explain --model``'s model)."""
    seen = False
    for p in model.parameters():
        if not p.is_meta:
            return False
        seen = True
    return seen


def _unbuilt(exc: BaseException) -> str:
    """Why the probe's stand-in forward failed, worded as what it is: a limit of the probe on this family (its masks,
    position embeddings or other inputs it does not build), not a failure of the model or of one-shot (a re-tester
    read the bare ``ValueError: not enough values to unpack`` as a crash)."""
    return (
        "the probe cannot build this family's layer inputs on stand-in weights: its forward stopped with "
        f"{type(exc).__name__}: {_first_line(exc)}"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else "no message"


def _fill(module: nn.Module, generator: torch.Generator) -> None:
    """Deterministic stand-in values for ``module``'s own parameters and buffers (just materialized): matrices
    ``N(0, 1 / fan_in)``, vectors (norm weights, biases, rotary frequencies) uniform in ``[0.5, 1.5]``, booleans
    ``True``, integers ``0``."""
    with torch.no_grad():
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if not isinstance(tensor, torch.Tensor):
                    continue
                if tensor.is_floating_point():
                    if tensor.dim() >= 2:
                        values = torch.randn(tensor.shape, generator=generator) / math.sqrt(tensor.shape[-1])
                    else:
                        values = torch.rand(tensor.shape, generator=generator) + 0.5
                    tensor.copy_(values.to(tensor.dtype))
                elif tensor.dtype == torch.bool:
                    tensor.fill_(True)
                else:
                    tensor.zero_()


def _materialize(layer: nn.Module, generator: torch.Generator) -> None:
    """``layer`` (on ``meta``) on the CPU with :func:`_fill`'s values."""
    layer.to_empty(device="cpu")
    for module in layer.modules():
        _fill(module, generator)


def _materialize_outside_layers(model: nn.Module, layers: nn.ModuleList, generator: torch.Generator) -> None:
    """The modules outside the decoder layers that hold buffers and no parameters (rotary embeddings' frequencies)
    on the CPU with :func:`_fill`'s values; the rest (embeddings, heads, towers) stays on ``meta`` (the probe gives
    the model ``inputs_embeds``)."""
    inside = {id(m) for m in layers.modules()}
    for module in model.modules():
        if id(module) in inside or any(True for _ in module.parameters(recurse=False)):
            continue
        if any(b is not None and b.is_meta for b in module._buffers.values()):
            module.to_empty(device="cpu", recurse=False)
            _fill(module, generator)


def _probe_inputs(
    model: nn.Module, layers: nn.ModuleList, index: int, hidden: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Decoder layer ``index``'s ``(args, kwargs)`` when ``model`` is given ``inputs_embeds=hidden``: the layers
    before it pass their hidden states through, and the forward stops at it (hidden states first in ``args``).

    Raises:
        RuntimeError: the forward did not reach the layer.
    """
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def passthrough(*args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs["hidden_states"]

    def record(*args: Any, **kwargs: Any) -> Any:
        captured.append((args, kwargs))
        raise _Captured

    saved = [layer.__dict__.get("forward") for layer in layers[: index + 1]]
    try:
        for layer in layers[:index]:
            layer.forward = passthrough
        layers[index].forward = record
        with contextlib.suppress(_Captured), torch.no_grad():
            model(inputs_embeds=hidden, use_cache=False)
    finally:
        for layer, forward in zip(layers[: index + 1], saved, strict=True):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
    if not captured:
        msg = f"the model's forward did not reach decoder layer {index}"
        raise RuntimeError(msg)
    args, kwargs = captured[0]
    if not args:
        kwargs = dict(kwargs)
        args = (kwargs.pop("hidden_states"),)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_value", "past_key_values")}
    return tuple(args), kwargs


@torch.no_grad()
def fold_change(
    layer: nn.Module, batch: tuple[tuple[Any, ...], dict[str, Any]], mappings: list[ResolvedMapping]
) -> float:
    """How much folding test scales into ``mappings`` changes what decoder ``layer`` computes on one calibration
    ``batch``: ``||y' - y|| / ||y - x||``, ``x`` the layer's input hidden states, ``y`` its output, ``y'`` its output
    with scales ``exp(u)``, ``u`` uniform in ``[-1, 1]`` (seeded), folded by
    :func:`~llmc_fsm_quantization.mappings.fold_scales`. Smoothing (SmoothQuant, arXiv 2211.10438 Sec. 4; AWQ, arXiv
    2306.00978 Sec. 3.2) must leave the float function unchanged; this measures it.

    Computed in float32 whatever the model's dtype (a bfloat16 layer's own rounding would otherwise be measured:
    ~1e-2 of ``||y - x||`` where the residual is large), on float32 copies of the layer's parameters and buffers:
    the layer's own tensors are not written, and are put back in place afterwards (the same storage). No forward
    hook sees the two forwards.

    Args:
        batch: the layer's ``(args, kwargs)`` for one batch, hidden states ``[B, T, H]`` first.

    Returns:
        The relative change (float; ``0.0`` when the layer computes nothing from its input).
    """
    args, kwargs = _float32(batch[0]), _float32(batch[1])
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    generator = torch.Generator().manual_seed(0)
    with suspended_forward_hooks(layer):
        try:
            for module in layer.modules():
                for table in (module._parameters, module._buffers):
                    for name, tensor in table.items():
                        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                            swapped.append((table, name, tensor))
                            copy = tensor.detach().to(torch.float32, copy=True)
                            table[name] = (
                                nn.Parameter(copy, requires_grad=False) if table is module._parameters else copy
                            )
            before = _hidden(layer(*args, **kwargs))
            for m in mappings:
                fold_scales(m, torch.empty(m.channels).uniform_(-1.0, 1.0, generator=generator).exp())
            after = _hidden(layer(*args, **kwargs))
        finally:
            for table, name, tensor in reversed(swapped):
                table[name] = tensor
    update = (before - args[0]).norm()
    change = (after - before).norm()
    return float(change / update) if float(update) > 0 else 0.0


def _float32(value: Any) -> Any:
    """``value`` with its floating tensors in float32 (tuples, lists and dicts of them too)."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float32) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_float32(v) for v in value))
    if isinstance(value, tuple | list):
        return type(value)(_float32(v) for v in value)
    if isinstance(value, dict):
        return {k: _float32(v) for k, v in value.items()}
    return value


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    try:
        return find_decoder_layers(model)[1]
    except ValueError:
        return None


def _held_on(module: nn.Module, device: torch.device) -> bool:
    """Whether every parameter of ``module`` is on ``device`` (not a streamed run's layer on ``meta``, not a layer
    left in CPU memory while the current one is onloaded to a GPU)."""
    return all(p.device == device for p in module.parameters())


def _mapping_shape(layer: nn.Module, mappings: list[ResolvedMapping]) -> tuple[Any, ...]:
    """``layer``'s class and its mappings by names within the layer: equal for layers whose folds are alike."""
    names = {id(module): name for name, module in layer.named_modules()}
    views = {id(v): f"{names.get(id(m), '?')}.{n}" for m in layer.modules() for n, v in weight_views(m).items()}

    def local(module: nn.Module, full: str) -> str:
        return names.get(id(module)) or views.get(id(module)) or full

    return (
        type(layer),
        tuple(
            (
                local(m.smooth, m.smooth_name),
                tuple(local(b, n) for b, n in zip(m.balances, m.balance_names, strict=True)),
            )
            for m in mappings
        ),
    )


def _some(names: tuple[str, ...]) -> str:
    shown = compact_names(names[:4])
    return shown if len(names) <= 4 else f"{shown} ... ({len(names)} balance layers)"


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple | list) else output


def _modules_of(mappings: list[ResolvedMapping]) -> dict[str, nn.Module]:
    out: dict[str, nn.Module] = {}
    for m in mappings:
        out[m.smooth_name] = m.smooth
        out.update(zip(m.balance_names, m.balances, strict=True))
    return out


class ActivationObserver:
    """Per-channel statistics of each mapping's balance input over a layer's calibration pass.

    Keeps, per mapping, ``max|x_j|`` and ``sum|x_j|`` (float32 / float64, ``[C]``), the token count and,
    when ``keep`` is set, the inputs themselves (AWQ needs them) and the parent block's ``(args, kwargs)``
    and output (:func:`block_output`). A norm mapping's reader (:attr:`ResolvedMapping.reader`: its first balance
    layer, or the mixture-of-experts block) must receive the norm's output tensor itself. The views of fused expert
    matrices get their inputs through :func:`~llmc_fsm.toolkit.views.observe_inputs` (each expert's routed
    tokens; every token with ``all_experts``, as a quantizer's ``calibrate_all_experts``); a per-expert mapping whose
    expert the router sent no token has no statistics (:meth:`check`).
    """

    def __init__(self, mappings: list[ResolvedMapping], *, keep: bool = False, all_experts: bool = False) -> None:
        self.mappings = mappings
        self.keep = keep
        self.all_experts = all_experts
        self.act_max: dict[str, torch.Tensor] = {}
        self.abs_sum: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        self.parent_inputs: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
        self.parent_outputs: dict[str, list[torch.Tensor]] = {}
        self._last_out: dict[int, Any] = {}
        self.problems: list[str] = []

    def run(self, layer: nn.Module, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        """Run every batch through ``layer`` with only this observer's hooks."""
        with suspended_forward_hooks(layer):
            handles = []
            try:
                sources = {id(v.source): v.source for m in self.mappings for v in (m.reader, m.parent)
                           if isinstance(v, LinearView) and v.expert is not None}  # fmt: skip
                observe = _observe_every_token if self.all_experts else _observe_routed
                for source in sources.values():
                    handles.append(source.register_forward_pre_hook(observe, with_kwargs=True))
                for m in self.mappings:
                    if m.smooth.weight.dim() == 1:
                        handles.append(m.smooth.register_forward_hook(self._norm_hook(m)))
                    handles.append(m.reader.register_forward_pre_hook(self._input_hook(m)))
                    if self.keep:
                        handles.append(m.parent.register_forward_pre_hook(self._parent_in(m), with_kwargs=True))
                        handles.append(m.parent.register_forward_hook(self._parent_out(m)))
                for args, kwargs in inputs:
                    layer(*args, **kwargs)
                    self._last_out.clear()
            finally:
                for handle in handles:
                    handle.remove()

    def _norm_hook(self, m: ResolvedMapping) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._last_out[id(module)] = output

        return hook

    def _input_hook(self, m: ResolvedMapping) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if m.smooth.weight.dim() == 1 and not _same_values(x, self._last_out.get(id(m.smooth))):
                reader = m.parent_name if m.reader is m.parent else m.balance_names[0]
                self.problems.append(
                    f"{reader} does not read the output of {m.smooth_name} (nor that output times a factor per token)"
                )
                return
            flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
            mx = flat.abs().amax(dim=0)
            sm = flat.abs().sum(dim=0, dtype=torch.float64)
            name = m.smooth_name
            self.act_max[name] = torch.maximum(self.act_max[name], mx) if name in self.act_max else mx
            self.abs_sum[name] = self.abs_sum[name] + sm if name in self.abs_sum else sm
            self.tokens[name] = self.tokens.get(name, 0) + flat.shape[0]

        return hook

    def _parent_in(self, m: ResolvedMapping) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.parent_inputs.setdefault(m.smooth_name, []).append((tuple(args), dict(kwargs)))

        return hook

    def _parent_out(self, m: ResolvedMapping) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if isinstance(module, LinearView):  # its call returned its input
                output = block_output(module, args, {})
            out = output[0] if isinstance(output, tuple | list) else output
            self.parent_outputs.setdefault(m.smooth_name, []).append(out.detach())

        return hook

    def all_reduce(self) -> None:
        """Combine the statistics of every rank (``torch.distributed``; a no-op in one process): the token counts by
        sum (one collective), then, mapping by mapping in order, ``max|x_j|`` by maximum and ``sum|x_j|`` by sum; a
        rank that saw no input of a mapping another rank saw (an expert its tokens were not routed to) takes part
        with zeros. A collective: every rank calls it after :meth:`run` on its own calibration inputs; then every
        rank holds what one process running all the inputs would (the maxima exactly, the float64 sums up to their
        order of addition)."""
        if not is_distributed():
            return
        names = list(dict.fromkeys(m.smooth_name for m in self.mappings))
        tokens = torch.tensor([self.tokens.get(name, 0) for name in names], dtype=torch.int64)
        all_reduce_tensor(tokens, what="all_reduce (smoothing tokens)")
        channels = {m.smooth_name: m.channels for m in self.mappings}
        for name, total in zip(names, tokens.tolist(), strict=True):
            if not total:
                continue
            if name not in self.act_max:  # no input here (an expert the router sent none of this rank's tokens)
                self.act_max[name] = torch.zeros(channels[name], dtype=torch.float32)
                self.abs_sum[name] = torch.zeros(channels[name], dtype=torch.float64)
            all_reduce_tensor(self.act_max[name], op="max", what="all_reduce (smoothing max|x|)")
            all_reduce_tensor(self.abs_sum[name], what="all_reduce (smoothing sum|x|)")
            self.tokens[name] = total

    def check(self, owner: str) -> None:
        """Raise if a norm mapping's data flow was not what its names said, a balance layer saw no input, or its
        inputs hold NaN / Inf.

        A per-expert mapping (its reader the view of an expert matrix) whose expert received no routed token is not
        an error: it has no statistics, and is left unsmoothed by the caller.

        Raises:
            ValueError: naming the mapping.
        """
        if self.problems:
            msg = (
                f"{owner}: {self.problems[0]} in the forward pass, so scales folded into it would change the "
                "model; give mappings whose first balance layer reads its smooth layer's output (the recipe's "
                "mappings: [{smooth_layer: ..., balance_layers: [...]}]), or leave that smooth layer out of them"
            )
            raise ValueError(msg)
        missing = [
            m.balance_names[0]
            for m in self.mappings
            if m.smooth_name not in self.tokens and not isinstance(m.reader, LinearView)
        ]
        if missing:
            msg = f"{owner}: {missing[0]} received no calibration input in its decoder layer's forward"
            raise ValueError(msg)
        broken = [
            name
            for m in self.mappings
            if m.smooth_name in self.act_max and not bool(torch.isfinite(self.act_max[m.smooth_name]).all())
            for name in m.balance_names
        ]
        if broken:  # NaN scales were folded into the layer silently (found this session)
            msg = (
                f"{owner}: the calibration inputs of {compact_names(broken)} hold NaN or Inf values, so they cannot "
                "be smoothed: the activations overflowed before them (a float16 model: load it in float32, --dtype "
                "float32 or model.float() for a model in memory) or a weight before them holds NaN or Inf"
            )
            raise ValueError(msg)


def _observe_routed(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    observe_inputs(module, args, kwargs, all_experts=False)


def _observe_every_token(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    observe_inputs(module, args, kwargs, all_experts=True)


def _weight_max(mapping: ResolvedMapping) -> torch.Tensor:
    return torch.cat([b.weight.detach().abs().to(torch.float32) for b in mapping.balances]).amax(dim=0)


def _scale_stats(scales: torch.Tensor) -> dict[str, float]:
    return {"scale_min": float(scales.min()), "scale_max": float(scales.max()), "scale_mean": float(scales.mean())}


@attrs.define(kw_only=True, slots=False, eq=False)
class SmoothQuantModifier(SmoothingModifier):
    """SmoothQuant: migrate activation outliers into the next weights before W8A8 (arXiv 2211.10438).

    Args:
        smoothing_strength: ``alpha`` in ``[0, 1]`` (default 0.5; the paper uses 0.5 for most models, up to
            0.75-0.85 for some); larger moves more of the range into the weights.
        mappings, ignore: see :class:`SmoothingModifier` (default mappings: the attention and MLP input norms).
        num_calibration_steps: llm-compressor's; only null (every calibration sample is used).
        calibration_function: llm-compressor's (a callable for its forward pass); only null.
        algorithm: ``smoothquant`` (default) or ``log_equalization``: the scales of
            :class:`LogarithmicEqualizationModifier` (llm-compressor 0.14's replacement for that modifier, and what its
            saved recipe.yaml records).

    Put a quantizing modifier after it, in the same stage or a later one (``GPTQModifier``/``QuantizationModifier``
    with ``W8A8``). Requires state ``model`` and ``calibration_data``; runs in the sequential pipeline.
    :attr:`smoothing_results`: per smooth layer ``scale_min/max/mean``, ``act_max_before`` / ``act_max_after``
    (the largest ``max|X_j|`` over channels before and after).
    """

    smoothing_strength: float = attrs.field(default=0.5, validator=_strength)
    num_calibration_steps: Any = attrs.field(default=None, validator=_steps)
    calibration_function: Any = attrs.field(default=None, validator=_calibration_function)
    algorithm: str = attrs.field(default="smoothquant", validator=_algorithm)

    def check_model(self, model: nn.Module) -> dict[str, nn.Module]:
        """:meth:`SmoothingModifier.check_model`; with the default mappings on a model whose llm-compressor 0.14
        default smooths the attention input only (:data:`LLMCOMPRESSOR_ATTENTION_ONLY`), one line saying so (found
        by a tester: the same recipe gave other weights than llm-compressor's saved recipe, which records its
        mappings)."""
        modules = super().check_model(model)
        family = type(model).__name__
        more = sorted({m.smooth_name.rsplit(".", 1)[-1] for m in self.resolve(model)} - {"input_layernorm"})
        if self.mappings is None and family in LLMCOMPRESSOR_ATTENTION_ONLY and more and family not in self._warned:
            self._warned.add(family)
            logger.warning(
                "%s: its default mappings also smooth into the readers of %s; llm-compressor 0.14's default "
                "mappings for %s smooth input_layernorm -> the attention's input projections only (it leaves the "
                "MoE blocks out: one scale across all experts): give mappings with that entry alone to smooth as "
                "it does",
                type(self).__name__,
                ", ".join(more),
                family,
            )
        return modules

    def _scales(self, act_max: torch.Tensor, mapping: ResolvedMapping) -> torch.Tensor:
        if self.algorithm == "log_equalization":
            return logarithmic_scales(act_max)
        return smoothquant_scales(act_max, _weight_max(mapping), float(self.smoothing_strength))

    def _smooth_layer_mappings(
        self, layer: nn.Module, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]], todo: list[ResolvedMapping]
    ) -> None:
        observer = ActivationObserver(todo)
        observer.run(layer, inputs)
        observer.all_reduce()
        observer.check(type(self).__name__)
        for mapping in todo:
            if mapping.smooth_name not in observer.act_max:
                continue  # an expert the router sent no calibration token (see ActivationObserver.check)
            act_max = observer.act_max[mapping.smooth_name]
            scales = self._scales(act_max, mapping)
            fold_scales(mapping, scales)
            self.smoothing_scales[mapping.smooth_name] = scales
            self.smoothing_results[mapping.smooth_name] = {
                "balance_layers": list(mapping.balance_names),
                **_scale_stats(scales),
                "act_max_before": float(act_max.max()),
                "act_max_after": float((act_max / scales).max()),
            }


@attrs.define(kw_only=True, slots=False, eq=False)
class LogarithmicEqualizationModifier(SmoothQuantModifier):
    """Logarithmic activation equalization: SmoothQuant with ``s_j = max|X_j| / log2(2 + max|X_j|)``.

    The scales depend on the activations only (``smoothing_strength`` is accepted, as in llm-compressor, and
    not used). Arguments and results otherwise as :class:`SmoothQuantModifier` (whose ``algorithm:
    log_equalization`` is the same).
    """

    algorithm: str = attrs.field(default="log_equalization", validator=_algorithm)


def _same_values(x: Any, out: Any) -> bool:
    """Whether the reader's input ``x`` is the norm's output ``out`` up to a factor per token, so that per-channel
    scales folded into the norm reach the reader unchanged (``(c_t y_t) / s = c_t (y_t / s)``).

    Taken as such: the same tensor; a view of it that keeps its channels as the last dimension (DeepSeek-V3's
    ``kv_b_proj`` reads ``kv_a_layernorm``'s output viewed as ``[batch, 1, seq, rank]``): same memory, as many values,
    the same last dimension and stride; or, as many values with the same last dimension, ``x_t = c_t y_t`` for each
    token ``t`` (``c_t`` the least-squares factor ``<x_t, y_t> / <y_t, y_t>``) up to :data:`_FACTOR_TOLERANCE` of
    ``||x||`` (float32): Falcon-H1's ``q_proj`` reads ``input_layernorm``'s output times ``attention_in_multiplier``,
    its ``mamba.in_proj`` times ``ssm_in_multiplier`` and a padding mask. An input that is not (the residual stream,
    another norm's output) differs by far more."""
    if x is out:
        return True
    if not (
        isinstance(x, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and x.numel() == out.numel()
        and x.dim() > 0
        and out.dim() > 0
        and x.shape[-1] == out.shape[-1]
    ):
        return False
    if x.data_ptr() == out.data_ptr() and x.stride(-1) == out.stride(-1):
        return True
    xs = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
    ys = out.detach().reshape(-1, out.shape[-1]).to(torch.float32)
    factor = (xs * ys).sum(dim=-1) / (ys * ys).sum(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    residual = (xs - factor[:, None] * ys).norm()
    return bool(torch.isfinite(factor).all()) and float(residual) <= _FACTOR_TOLERANCE * float(xs.norm())


#: :func:`_same_values`: the largest ``||x - c y|| / ||x||`` of a reader input taken as the norm's output ``y`` times a
#: per-token factor ``c``: a bfloat16 product's rounding is about 2e-3 of it.
_FACTOR_TOLERANCE = 1e-2
