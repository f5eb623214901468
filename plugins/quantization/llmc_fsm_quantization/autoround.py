"""AutoRound (SignRound): signed-gradient tuning of the rounding and clipping of each decoder layer's weights.

Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent for the
Quantization of LLMs" (arXiv 2309.05516), Sec. 3. For every quantized Linear of a
decoder layer, with ``s``/``z`` the scale and zero point of a weight group:

* ``W_hat = s * (clamp(round(W / s + V) + z, q_min, q_max) - z)``, where the
  rounding offsets ``V`` (same shape as ``W``) lie in ``[-0.5, 0.5]``;
* ``s, z`` come from the group's range clipped by learnable factors,
  ``[beta * min(W), alpha * max(W)]`` with ``alpha, beta`` in ``[0.5, 1]`` (one each
  per group). Asymmetric schemes take them from compressed-tensors' ``calculate_qparams``.
  Symmetric schemes use the whole integer range as auto-round does (its ``int_sym``,
  from llama.cpp): the side of larger magnitude maps exactly onto ``q_min = -2^(b-1)``,
  so ``s = -alpha * max(W) / 2^(b-1)`` (a negative scale) when the maximum is larger and
  ``s = -beta * min(W) / 2^(b-1)`` otherwise, ``z = 0``. compressed-tensors' own symmetric
  scale, ``max|W| / 7.5`` for 4 bits, leaves the grid's ``-8`` unused on one side and
  rounds the maximum to ``7``. The checkpoint's packer reproduces the integers exactly
  either way (``round(W_hat / s)``), and transformers dequantizes ``q * s``;
* ``V, alpha, beta`` start at ``0, 1, 1`` (round-to-nearest with the min/max range)
  and take ``iters`` steps of signed gradient descent,
  ``p <- p - lr_t * sign(dL/dp)``, ``lr_t`` decaying linearly from ``lr`` to 0,
  on the mean squared error between the layer's output with the quantized weights
  and its float output, over ``batch_size`` calibration samples drawn at random
  each step; ``round`` passes the gradient straight through;
* the parameters of the step with the lowest loss are kept; if they do not lower
  the error on all calibration samples below round-to-nearest's, round-to-nearest
  is kept (:attr:`AutoRoundModifier.layer_errors` says which).

The layer's inputs are those the sequential pipeline propagates (through the
layers already quantized, as GPTQ sees them); the target is the float model's own
output of the layer, i.e. the float layer on the float model's inputs, which the
modifier carries from layer to layer (auto-round's ``enable_quanted_input``, its
default: each layer learns to correct the error the quantized layers before it
left). On SmolLM2-135M with 10 iterations, targets computed on the propagated
inputs instead gave perplexity 55.98 (docs/rotations_autoround.md). A resumed run
gets the float model's inputs to its first layer from the pipeline, which runs the
restored layers as loaded (``resume_float_inputs``). Only the sequential pipeline's
plain order runs (the modifier hooks the whole decoder layer). The ``auto-round`` package is not used: it would install
beside torch 2.13 (pip's dry run adds datasets, pandas, pyarrow) but quantizes
through its own wrappers and formats; this is the paper's algorithm on the
compressed-tensors scheme, written here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.utils import calculate_qparams, calculate_range
from torch import nn

from llmc_fsm import find_decoder_layers, first_output
from llmc_fsm.toolkit import LinearView, is_distributed, weight_views
from llmc_fsm_quantization._base import QuantizedWeight, QuantizingModifier
from llmc_fsm_quantization.observers import as_row_args, storable

#: Per calibration batch: the (positional args, keyword args) a decoder layer is called with.
Inputs = list[tuple[tuple[Any, ...], dict[str, Any]]]

__all__ = ["AutoRoundModifier", "LayerErrors", "signround_layer"]

logger = logging.getLogger(__name__)

#: Range of the clipping factors alpha (of the maximum) and beta (of the minimum), Sec. 3 of the paper.
CLIP_RANGE = (0.5, 1.0)
#: Seed of the random choice of calibration samples per step (auto-round's default seed).
SEED = 42
#: Smallest magnitude of a symmetric scale (auto-round's ``q_scale_thresh``).
SCALE_FLOOR = 1e-5


@attrs.frozen
class LayerErrors:
    """Mean squared error of a decoder layer's output against the float model's output of that layer, on all
    calibration samples (so it includes the error the quantized layers before it pass on).

    Attributes:
        rtn: with round-to-nearest on the same grid (``V = 0``, ``alpha = beta = 1``).
        tuned: with the best tuned parameters.
        kept: ``"autoround"`` or ``"rtn"`` (when tuning did not lower the error).
    """

    rtn: float
    tuned: float
    kept: str

    def as_dict(self) -> dict[str, Any]:
        """``{"rtn_mse", "tuned_mse", "kept"}`` (JSON values: floats and a str), as the report and a resumed run's
        saved progress hold it."""
        return {"rtn_mse": float(self.rtn), "tuned_mse": float(self.tuned), "kept": str(self.kept)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerErrors:
        """The :class:`LayerErrors` that :meth:`as_dict` returned ``data`` for.

        Raises:
            KeyError: ``data`` lacks ``rtn_mse``, ``tuned_mse`` or ``kept``.
        """
        return cls(rtn=float(data["rtn_mse"]), tuned=float(data["tuned_mse"]), kept=str(data["kept"]))


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` whose gradient is the identity (straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


class _Tuned:
    """One Linear's learnable rounding offsets and clipping factors, and its quantized weight from them."""

    def __init__(self, weight: torch.Tensor, args: QuantizationArgs) -> None:
        self.dtype = weight.dtype
        w = weight.detach().to(torch.float32)
        rows, cols = w.shape
        gs = args.group_size if args.strategy == QuantizationStrategy.GROUP else cols
        if cols % gs:
            msg = f"in_features {cols} is not a multiple of group_size {gs}"
            raise ValueError(msg)
        self.shape = (rows, cols // gs, gs)
        self.w = w.reshape(self.shape)
        self.lo = self.w.amin(dim=-1)
        self.hi = self.w.amax(dim=-1)
        self.row_args = as_row_args(args)
        q_min, q_max = calculate_range(self.row_args, w.device)
        self.q_min, self.q_max = float(q_min), float(q_max)
        self.v = torch.zeros_like(w).reshape(self.shape).requires_grad_()
        self.alpha = torch.ones_like(self.hi).requires_grad_()
        self.beta = torch.ones_like(self.lo).requires_grad_()

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.v, self.alpha, self.beta]

    def qparams(self, *, final: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point ``[rows, groups]`` from the clipped range (differentiable in the scale).

        Symmetric: the whole range, the side of larger magnitude on ``q_min`` (signed scale, see the module
        docstring; ``|s| >= 1e-5`` as auto-round); asymmetric: compressed-tensors' ``calculate_qparams``.
        """
        if self.row_args.symmetric:
            hi = self.hi.clamp(min=0) * self.alpha
            neg = -(self.lo.clamp(max=0) * self.beta)  # magnitude of the clipped minimum
            scale = torch.where(hi < neg, neg, -hi) / -self.q_min
            scale = torch.where(scale < 0, scale.clamp(max=-SCALE_FLOOR), scale.clamp(min=SCALE_FLOOR))
            if final:
                scale = storable(scale.detach(), self.dtype)
            return scale, torch.zeros(self.shape[:2], dtype=self.row_args.zp_dtype, device=scale.device)
        lo = (self.lo * self.beta).reshape(-1, 1)
        hi = (self.hi * self.alpha).reshape(-1, 1)
        scale, zp = calculate_qparams(lo, hi, self.row_args)
        if final:
            scale = storable(scale.detach(), self.dtype)
        return scale.reshape(self.shape[:2]), zp.reshape(self.shape[:2])

    def quantized(self, *, final: bool = False) -> torch.Tensor:
        """``W_hat`` ``[rows, cols]`` (float32; the integers are ``round(W / s + V) + z`` clamped)."""
        scale, zp = self.qparams(final=final)
        s, z = scale.unsqueeze(-1), zp.to(torch.float32).unsqueeze(-1)
        x = self.w / s + self.v
        q = (torch.round(x) if final else _round_ste(x)) + z
        q = q.clamp(self.q_min, self.q_max)
        return ((q - z) * s).reshape(self.shape[0], -1)

    @torch.no_grad()
    def clamp_(self) -> None:
        self.v.clamp_(-0.5, 0.5)
        self.alpha.clamp_(*CLIP_RANGE)
        self.beta.clamp_(*CLIP_RANGE)

    def snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def load(self, values: Sequence[torch.Tensor]) -> None:
        for p, value in zip(self.params, values, strict=True):
            p.copy_(value)

    @torch.no_grad()
    def result(self) -> QuantizedWeight:
        scale, zp = self.qparams(final=True)
        return QuantizedWeight(weight=self.quantized(final=True).to(self.dtype), scale=scale, zero_point=zp)


def _rows(value: Any, rows: int, index: torch.Tensor) -> Any:
    """``value`` with every tensor whose first dimension is the batch (``rows``) restricted to ``index``."""
    if isinstance(value, torch.Tensor):
        return value[index] if value.dim() > 0 and value.shape[0] == rows and rows > 1 else value
    if isinstance(value, tuple | list):
        return type(value)(_rows(v, rows, index) for v in value)
    if isinstance(value, dict):
        return {k: _rows(v, rows, index) for k, v in value.items()}
    return value


def signround_layer(
    layer: nn.Module,
    targets: dict[str, nn.Module],
    inputs: Inputs,
    outputs: list[torch.Tensor],
    *,
    args: QuantizationArgs,
    iters: int = 200,
    lr: float | None = None,
    batch_size: int = 8,
    seed: int = SEED,
) -> tuple[dict[str, QuantizedWeight], LayerErrors]:
    """Quantize ``targets`` of ``layer`` with SignRound on the layer's output error (see the module docstring).

    Args:
        layer: the decoder layer (its weights are not modified here).
        targets: ``{name relative to layer: Linear}`` to quantize; a fused experts module's matrices as
            :class:`~llmc_fsm.toolkit.LinearView` s (``mlp.experts.3.gate_proj``), all of its parameter's matrices:
            the layer then runs with that parameter rebuilt from their quantized matrices at every step.
        inputs: per calibration batch, the layer's ``(args, kwargs)``; ``args[0]`` is ``[B, L, hidden]``.
        outputs: per batch, the target hidden states (the modifier gives the float model's output of the layer).
        args: the weights' ``QuantizationArgs`` (integer, channel or group strategy).
        iters: signed-gradient steps (>= 1).
        lr: step size of ``V``, ``alpha`` and ``beta``; default ``1 / iters`` (auto-round's).
        batch_size: calibration samples (rows of the batches) per step.
        seed: seed of the random choice of samples.

    Returns:
        ``{name: QuantizedWeight}`` (dequantized weight in the weight's dtype, scale, zero point) and the
        layer's :class:`LayerErrors`.
    """
    lr = 1.0 / iters if lr is None else float(lr)
    tuned = {name: _Tuned(m.weight, args) for name, m in targets.items()}
    params = [p for t in tuned.values() for p in t.params]
    samples = [(b, r) for b, (a, _) in enumerate(inputs) for r in range(a[0].shape[0])]
    gen = torch.Generator().manual_seed(seed)

    owners = {id(m): n for n, m in layer.named_modules()}

    def quantized_weights(final: bool) -> dict[str, torch.Tensor]:
        """The layer's parameters to call it with: each target's quantized weight; a fused experts parameter
        rebuilt from its matrices' (every matrix of it is a target: the copy's values are all replaced)."""
        weights: dict[str, torch.Tensor] = {}
        for name, t in tuned.items():
            module, w = targets[name], t.quantized(final=final).to(t.dtype)
            if not isinstance(module, LinearView):
                weights[f"{name}.weight"] = w
                continue
            key = f"{owners[id(module.owner)]}.{module.param_name}"
            if key not in weights:
                weights[key] = getattr(module.owner, module.param_name).detach().clone()
            module.matrix_of(weights[key]).copy_(w)
        return weights

    def forward_error(chosen: Sequence[tuple[int, int]], *, final: bool = False) -> tuple[torch.Tensor, int]:
        weights = quantized_weights(final)
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        by_batch: dict[int, list[int]] = {}
        for b, r in chosen:
            by_batch.setdefault(b, []).append(r)
        for b, rows in by_batch.items():
            (a, kw), target = inputs[b], outputs[b]
            n = a[0].shape[0]
            index = torch.tensor(rows)
            call_args, call_kw = _rows(a, n, index), _rows(kw, n, index)
            out = first_output(torch.func.functional_call(layer, weights, call_args, call_kw, strict=False))
            diff = out.to(torch.float32) - target[index].to(torch.float32)
            total = total + diff.pow(2).sum().to(torch.float64)
            count += diff.numel()
        return total, count

    def full_error(final: bool) -> float:
        with torch.no_grad():
            total, count = forward_error(samples, final=final)
        return float(total) / count

    rtn = full_error(final=True)
    best_loss, best = float("inf"), [t.snapshot() for t in tuned.values()]
    with torch.enable_grad():
        for step in range(iters):
            pick = torch.randperm(len(samples), generator=gen)[: min(batch_size, len(samples))].tolist()
            total, count = forward_error([samples[i] for i in sorted(pick)])
            loss = total / count
            if float(loss.detach()) < best_loss:
                best_loss, best = float(loss.detach()), [t.snapshot() for t in tuned.values()]
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            step_lr = lr * (1.0 - step / iters)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    if g is not None:
                        p.sub_(step_lr * torch.sign(g))
            for t in tuned.values():
                t.clamp_()
    for t, values in zip(tuned.values(), best, strict=True):
        t.load(values)
    tuned_error = full_error(final=True)
    kept = "autoround"
    if not tuned_error < rtn:
        kept = "rtn"
        for t in tuned.values():
            t.load([torch.zeros_like(t.v), torch.ones_like(t.alpha), torch.ones_like(t.beta)])
    return {name: t.result() for name, t in tuned.items()}, LayerErrors(rtn=rtn, tuned=tuned_error, kept=kept)


# --------------------------------------------------------------------------- the modifier
def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        rtn_mode = value == 0 and attribute.name == "iters"
        extra = "; iters: 0 is auto-round's round-to-nearest mode: use QuantizationModifier" if rtn_mode else ""
        msg = f"{attribute.name} must be a positive int, got {value!r}{extra}"
        raise ValueError(msg)


def _lr(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0):
        msg = f"lr must be a positive number or null (1 / iters), got {value!r}"
        raise ValueError(msg)


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        msg = f"{attribute.name} must be true or false, got {value!r}"
        raise ValueError(msg)


def _device_ids(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        msg = f"device_ids {value!r} is not supported: each decoder layer is tuned on the device it is on; remove it"
        raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class AutoRoundModifier(QuantizingModifier):
    """Quantize Linear weights with AutoRound (SignRound): rounding and clipping tuned per decoder layer.

    Args (llm-compressor's names and defaults; besides ``scheme``, ``targets``, ``ignore``):
        iters: signed-gradient steps per decoder layer (default 200).
        lr: step size (default ``null``: ``1 / iters``, as auto-round).
        batch_size: calibration samples per step (default 8).
        enable_torch_compile: accepted (default true) and has no effect: the tuning loop is not compiled.
        disable_opt_rtn: accepted, no effect (it concerns auto-round's ``iters: 0`` mode, which is refused).
        device_ids: only ``null``.

    The scheme must quantize weights only, as integers with channel or group
    strategy (``W4A16``, ``W8A16``, ...); ``observer`` must be ``minmax`` (AutoRound
    tunes the range itself). Requires state ``model`` and ``calibration_data``; runs
    in one process. Memory: the current layer's inputs, its output on them and the float
    model's hidden states before and after it, for every calibration sample, and three
    tensors per weight (``V``, and per group ``alpha``, ``beta``).
    After the run :attr:`layer_errors` holds each layer's :class:`LayerErrors` (the one-shot report's ``tuning``
    section, :attr:`tuning_results`; kept across ``--resume`` by :meth:`progress_state`).

    Raises (at construction): ``ValueError`` for an unsupported scheme or argument.
    """

    #: Under torch.distributed every rank tunes every module (its per-layer tuning state is not handed over).
    shares_work_across_ranks = False
    #: Fused experts: each expert matrix tuned with the layer's other targets (:func:`signround_layer`).
    compresses_views = True

    iters: int = attrs.field(default=200, validator=_positive_int)
    lr: float | None = attrs.field(default=None, validator=_lr)
    batch_size: int = attrs.field(default=8, validator=_positive_int)
    enable_torch_compile: bool = attrs.field(default=True, validator=_bool)
    disable_opt_rtn: bool = attrs.field(default=False, validator=_bool)
    device_ids: str | None = attrs.field(default=None, validator=_device_ids)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if len(self.quantization_schemes) > 1:
            msg = (
                "AutoRoundModifier tunes one scheme per modifier; config_groups gives "
                f"{len(self.quantization_schemes)} "
                f"({', '.join(self.quantization_schemes)}): split them into one AutoRoundModifier per group"
            )
            raise ValueError(msg)
        scheme = self.quantization_scheme
        w = scheme.weights
        problem = None
        if scheme.input_activations is not None or scheme.output_activations is not None:
            problem = "it quantizes activations"
        elif w is None or str(getattr(w.type, "value", w.type)) != "int":
            problem = "its weights are not integers"
        elif w.strategy not in (QuantizationStrategy.CHANNEL, QuantizationStrategy.GROUP):
            problem = f"its weight strategy is {getattr(w.strategy, 'value', w.strategy)}"
        if problem is not None:
            msg = (
                f"AutoRoundModifier tunes integer weight-only schemes with channel or group strategy (W4A16, W8A16, "
                f"...): the scheme given is not supported ({problem}); use GPTQModifier or QuantizationModifier for it"
            )
            raise ValueError(msg)
        if self.observer != "minmax":
            msg = f"AutoRoundModifier tunes the weight range itself: observer must be minmax, got {self.observer!r}"
            raise ValueError(msg)
        #: decoder layer name -> :class:`LayerErrors`, in the order the layers were tuned.
        self.layer_errors: dict[str, LayerErrors] = {}
        self._layers: dict[int, tuple[str, nn.Module]] = {}
        self._captured: dict[int, tuple[Inputs, list[torch.Tensor]]] = {}
        self._tuning = False  # the tuning loop's own forwards are not captured
        self._done: set[int] = set()  # layers tuned: the pipeline's propagation through them is not captured
        #: per calibration batch, the float model's hidden states entering the next layer (``None``: the same as
        #: the pipeline's, before the first layer)
        self._float_hidden: list[torch.Tensor] | None = None
        self._output_hooks: list[Any] = []  # torch handles of the layers' output hooks, while outputs are captured

    # ---- hooks --------------------------------------------------------------------------------
    def on_initialize(self, state: Any) -> None:
        super().on_initialize(state)
        name, layers = find_decoder_layers(state.model)
        inside = {id(v) for m in layers.modules() for v in (m, *weight_views(m).values())}  # fused experts' views
        outside = [n for n, m in self._targets.items() if id(m) not in inside]
        if outside:
            msg = (
                f"AutoRoundModifier tunes decoder layers; {', '.join(outside[:5])} lie outside {name}: add them to "
                "ignore"
            )
            raise ValueError(msg)
        self.layer_errors = {}
        # every decoder layer, also one without targets: the float model's hidden states go through each
        self._layers = {id(layer): (f"{name}.{i}", layer) for i, layer in enumerate(layers)}

    def on_calibration_start(self, state: Any) -> None:
        if is_distributed():
            msg = "AutoRoundModifier runs in one process: start it without torchrun (or with one process)"
            raise ValueError(msg)
        self._float_hidden = None
        self._output_hooks = []
        for key, (_, layer) in self._layers.items():
            self.register_hook(layer, self._capture_input(key), kind="forward_pre", with_kwargs=True)
            self._output_hooks.append(self.register_hook(layer, self._capture_output(key), kind="forward"))

    def _capture_input(self, key: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._tuning or key in self._done:
                return
            if not args and "hidden_states" in kwargs:
                kwargs = dict(kwargs)
                args = (kwargs.pop("hidden_states"),)
            self._captured.setdefault(key, ([], []))[0].append((tuple(args), dict(kwargs)))

        return hook

    def _capture_output(self, key: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            # past the first layer the target is the float model's output (:meth:`_float_outputs`), not this one
            if not self._tuning and key not in self._done and self._float_hidden is None:
                self._captured.setdefault(key, ([], []))[1].append(first_output(output).detach())

        return hook

    def on_sequential_epoch_end(self, state: Any, modules: Any) -> None:
        roots = [modules] if isinstance(modules, nn.Module) else list(modules)
        layers = [sub for root in roots for sub in root.modules() if id(sub) in self._layers]
        for layer in layers:
            if id(layer) in self._captured:
                self._tune(*self._layers[id(layer)], id(layer))
        if layers:  # targets of these layers that saw no calibration input: listed in skipped
            super().on_sequential_epoch_end(state, layers)

    def on_calibration_end(self, state: Any) -> None:
        self._captured.clear()
        self._done.clear()
        self._float_hidden = None
        super().on_calibration_end(state)

    def on_finalize(self, state: Any) -> None:
        self._captured.clear()
        self._float_hidden = None
        super().on_finalize(state)

    def resume_float_inputs(self, inputs: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        """On a resumed run, before the first layer to compress: its calibration inputs as the float model computes
        them (the pipeline ran the restored layers as loaded, before restoring them), per batch ``(args,
        kwargs)`` with the hidden states ``[B, L, hidden]`` first."""
        self._carry_float_hidden([args[0].detach() for args, _ in inputs])

    # ---- report and resume ------------------------------------------------------------------------
    @property
    def tuning_results(self) -> dict[str, dict[str, Any]]:
        """:attr:`layer_errors` as JSON values for the one-shot report (its ``tuning`` section,
        :class:`llmc_fsm.report.build.OneshotReport`): decoder layer name -> ``{"rtn_mse", "tuned_mse", "kept"}``
        (:meth:`LayerErrors.as_dict`), in the order the layers were tuned."""
        return {name: errors.as_dict() for name, errors in self.layer_errors.items()}

    def progress_state(self, layer: nn.Module) -> dict[str, Any]:
        """What tuning decoder ``layer`` measured, as JSON values, for a one-shot run's per-layer progress
        (:mod:`llmc_fsm.oneshot_job.resume`; the layer's weights are saved with it): ``{"layer_errors": {name:
        LayerErrors.as_dict()}}``, empty when the layer was not tuned (no target in it)."""
        name = self._layers.get(id(layer), (None,))[0]
        errors = self.layer_errors.get(name) if name is not None else None
        return {"layer_errors": {name: errors.as_dict()} if errors is not None else {}}

    def restore_progress_state(self, layer: nn.Module, state: dict[str, Any]) -> None:
        """Take back :meth:`progress_state` of decoder ``layer`` into :attr:`layer_errors`, so that a resumed run
        reports the restored layers' tuning too.

        Raises:
            ValueError: the state names another decoder layer than ``layer`` (progress of another model).
        """
        name = self._layers.get(id(layer), (None,))[0]
        saved = state.get("layer_errors", {})
        other = [n for n in saved if n != name]
        if other:
            msg = f"AutoRoundModifier: saved progress names {other[0]}, not this decoder layer ({name})"
            raise ValueError(msg)
        self.layer_errors.update({n: LayerErrors.from_dict(e) for n, e in saved.items()})

    # ---- work ---------------------------------------------------------------------------------
    def _tune(self, layer_name: str, layer: nn.Module, key: int) -> None:
        inputs, outputs = self._captured.pop(key)
        self._done.add(key)
        if self._float_hidden is None and len(inputs) != len(outputs):  # a forward stopped early
            msg = f"AutoRoundModifier: {layer_name} ran {len(inputs)} times but returned {len(outputs)} outputs"
            raise RuntimeError(msg)
        outputs = self._float_outputs(layer, inputs, outputs)
        ids = {id(m) for m in self._targets.values()}
        rel = {
            f"{n}.{suffix}" if suffix else n: sub
            for n, m in layer.named_modules()
            for suffix, sub in ((None, m), *weight_views(m).items())
            if id(sub) in ids and self._names_by_id[id(sub)] not in self.results
        }
        if not rel:
            return
        t0 = time.perf_counter()
        self._tuning = True
        try:
            quantized, errors = signround_layer(
                layer,
                rel,
                inputs,
                outputs,
                args=self.weight_args,
                iters=self.iters,
                lr=self.lr,
                batch_size=self.batch_size,
            )
        finally:
            self._tuning = False
        self.layer_errors[layer_name] = errors
        logger.info(
            "AutoRoundModifier: %s output MSE %.4g (round-to-nearest %.4g), kept %s, %.1f s",
            layer_name,
            errors.tuned,
            errors.rtn,
            errors.kept,
            time.perf_counter() - t0,
        )
        tokens = sum(int(a[0].shape[0] * a[0].shape[1]) for a, _ in inputs)
        acc = _Tuning(quantized={id(rel[n]): q for n, q in quantized.items()}, num_samples=tokens)
        pending = {self._names_by_id[id(m)]: m for m in rel.values()}
        for name in pending:
            self._acc[name] = acc
        self._compress_all(pending)

    def _float_outputs(self, layer: nn.Module, inputs: Inputs, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The float model's output of ``layer`` per batch (its weights not yet quantized), kept as the next layer's
        float inputs: ``outputs`` (the layer on the pipeline's inputs) while those are the float model's, else the
        layer run on the float hidden states carried from the layer before, with each batch's other arguments."""
        if self._float_hidden is not None:
            if len(self._float_hidden) != len(inputs):
                msg = (
                    f"AutoRoundModifier: {len(inputs)} calibration batches reached this layer, but the float model's "
                    f"hidden states were carried for {len(self._float_hidden)}"
                )
                raise RuntimeError(msg)
            self._tuning = True  # these forwards are not captured
            try:
                with torch.no_grad():
                    outputs = [
                        first_output(layer(hidden, *args[1:], **kwargs)).detach()
                        for hidden, (args, kwargs) in zip(self._float_hidden, inputs, strict=True)
                    ]
            finally:
                self._tuning = False
        self._carry_float_hidden(outputs)
        return outputs

    def _carry_float_hidden(self, hidden: list[torch.Tensor]) -> None:
        """From now on the float model's hidden states are carried from layer to layer: no layer's output is
        captured again, so the output hooks go (the pipeline's calibration pass of a later layer then stops at the
        layer's input, :func:`llmc_fsm.pipeline.layer.early_exit_module`: only its inputs are needed)."""
        self._float_hidden = hidden
        for handle in self._output_hooks:
            handle.remove()
        self._output_hooks = []

    def _embedding_problem(self, name: str) -> str | None:
        """AutoRound tunes the Linears of the decoder layers on their output: an Embedding target is refused with
        the fix, before any work (it was refused in ``initialize``, as a target outside the layers)."""
        return (
            "AutoRound tunes the decoder layers' Linears on their output error: quantize the embedding with a "
            "QuantizationModifier (round-to-nearest, weight only) in the same stage"
        )

    def _new_accumulator(self, module: nn.Module) -> Any:
        return None  # no per-module statistics: the layer's inputs are captured whole

    def _record_routed(self) -> None:
        """Nothing: the experts' matrices are tuned on the decoder layer's output error, whatever tokens each
        expert was routed (no per-expert statistics are observed, so there are no routed counts to report)."""

    def _quantize(self, modules: list[nn.Module], accumulator: Any, args: Any) -> list[QuantizedWeight]:
        return [accumulator.quantized[id(m)] for m in modules]


@attrs.define
class _Tuning:
    """What a decoder layer's tuning produced, handed to :meth:`CalibratedModifier._compress_all` as the
    targets' shared accumulator (one group: the layer's targets)."""

    quantized: dict[int, QuantizedWeight]
    num_samples: int
    in_features: int = 0
