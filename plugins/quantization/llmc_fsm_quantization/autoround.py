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
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from compressed_tensors.quantization import (
    DynamicType,
    QuantizationArgs,
    QuantizationScheme,
    QuantizationStrategy,
    QuantizationType,
    round_to_quantized_type_args,
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as _library_fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, calculate_range, compute_dynamic_scales_and_zp
from torch import nn

from llmc_fsm import find_decoder_layers, first_output
from llmc_fsm.toolkit import CalibratedModifier, LinearView, is_distributed, own_forwards, weight_views
from llmc_fsm_quantization._base import (
    QuantizedWeight,
    QuantizingModifier,
    _input_global_scale,
    _input_qparams,
    _observed_whole,
    _static_inputs,
    attach_qparams,
)
from llmc_fsm_quantization.observers import (
    as_row_args,
    fused_global_scale,
    importance_from_diagonal,
    is_local,
    is_nvfp4,
    is_scaled_format,
    storable,
)
from llmc_fsm_quantization.rounding import fake_quantize

#: Per calibration batch: the (positional args, keyword args) a decoder layer is called with.
Inputs = list[tuple[tuple[Any, ...], dict[str, Any]]]

__all__ = ["AutoRoundModifier", "LayerErrors", "signround_layer"]

logger = logging.getLogger(__name__)

#: The refusal under torch.distributed (each rank would tune every layer on its share of the calibration data).
ONE_PROCESS = "AutoRoundModifier runs in one process: start it without torchrun (or with one process)"

#: Range of the clipping factors alpha (of the maximum) and beta (of the minimum), Sec. 3 of the paper.
CLIP_RANGE = (0.5, 1.0)
#: Seed of the random choice of calibration samples per step (auto-round's default seed).
SEED = 42
#: Smallest magnitude of a symmetric scale (auto-round's ``q_scale_thresh``).
SCALE_FLOOR = 1e-5
#: Weight observers accepted: the weight's own min/max (a weight is observed once, so the moving average, the
#: running extremes and the last observation are the same range); llm-compressor 0.14's saved AutoRound recipe writes
#: ``memoryless_minmax`` into each config group's weights.
_RANGE_OBSERVERS = frozenset({"minmax", "static_minmax", "memoryless_minmax"})


@attrs.frozen
class LayerErrors:
    """Mean squared error of a decoder layer's output against the float model's output of that layer, on all
    calibration samples (so it includes the error the quantized layers before it pass on).

    Attributes:
        rtn: with round-to-nearest on the same grid (``V = 0``, ``alpha = beta = 1``); ``None`` with ``iters: 0``
            (nothing is tuned, so no error is measured: the modifier then runs no forward of its own).
        tuned: with the best tuned parameters; ``None`` with ``iters: 0``.
        kept: ``"autoround"``, ``"rtn"`` (when tuning did not lower the error), ``"rtn_mode"`` (``iters: 0``: no
            tuning; both errors are round-to-nearest's) or ``"opt_rtn_mode"`` (``iters: 0`` with auto-round's
            optimized round-to-nearest: ``tuned`` is the error with the searched ranges).
    """

    rtn: float | None
    tuned: float | None
    kept: str

    def as_dict(self) -> dict[str, Any]:
        """``{"rtn_mse", "tuned_mse", "kept"}`` (JSON values: floats or null, and a str), as the report and a resumed
        run's saved progress hold it."""
        return {"rtn_mse": _or_none(self.rtn), "tuned_mse": _or_none(self.tuned), "kept": str(self.kept)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerErrors:
        """The :class:`LayerErrors` that :meth:`as_dict` returned ``data`` for.

        Raises:
            KeyError: ``data`` lacks ``rtn_mse``, ``tuned_mse`` or ``kept``.
        """
        return cls(rtn=_or_none(data["rtn_mse"]), tuned=_or_none(data["tuned_mse"]), kept=str(data["kept"]))


def _or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` whose gradient is the identity (straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


def _grouped(w: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """``w`` ``[rows, cols]`` as ``[A, B, n]``: one row of ``n`` values per scale, the scales ``[A, B]`` shaped as
    compressed-tensors stores them (tensor ``[1, 1]``, channel ``[rows, 1]``, group / tensor_group
    ``[rows, cols // group_size]``, block ``[rows // r, cols // c]``; a block's ``r * c`` values row by row).

    Raises:
        ValueError: the columns are not a multiple of the group size, or the weight not of whole blocks.
    """
    rows, cols = w.shape
    strategy = args.strategy
    if strategy == QuantizationStrategy.TENSOR:
        return w.reshape(1, 1, rows * cols)
    if strategy == QuantizationStrategy.BLOCK:
        r, c = (int(v) for v in args.block_structure)
        if rows % r or cols % c:
            msg = f"weight [{rows}, {cols}] is not a whole number of [{r}, {c}] blocks"
            raise ValueError(msg)
        return w.reshape(rows // r, r, cols // c, c).permute(0, 2, 1, 3).reshape(rows // r, cols // c, r * c)
    gs = cols if strategy == QuantizationStrategy.CHANNEL else int(args.group_size)
    if cols % gs:
        msg = f"in_features {cols} is not a multiple of group_size {gs}"
        raise ValueError(msg)
    return w.reshape(rows, cols // gs, gs)


def _ungrouped(g: torch.Tensor, args: QuantizationArgs, rows: int, cols: int) -> torch.Tensor:
    """The inverse of :func:`_grouped`: ``[rows, cols]``."""
    if args.strategy == QuantizationStrategy.BLOCK:
        r, c = (int(v) for v in args.block_structure)
        return g.reshape(rows // r, cols // c, r, c).permute(0, 2, 1, 3).reshape(rows, cols)
    return g.reshape(rows, cols)


class _Tuned:
    """One Linear's learnable rounding offsets and clipping factors, and its quantized weight from them.

    Integer weights: the grid of the module docstring. Float weights (FP8 per tensor, channel or block, NVFP4,
    MXFP4 / MXFP8), as auto-round's ``fp8_sym`` / ``nv_fp`` / ``mx_fp`` data types: ``W_hat = s * fp(clamp(W / s
    + V, -m, m))``, ``fp`` the rounding to the format's nearest value (compressed-tensors'
    ``round_to_quantized_type_args``: FP8 E4M3, FP4 E2M1), ``m`` its largest value (448, 6) and ``s`` the scale
    compressed-tensors computes from the clipped range ``[beta * min W, alpha * max W]`` of the group (NVFP4: an
    FP8 group scale under the weight's global scale, ``s / global`` effective; MX: a power of two), exactly as
    round-to-nearest computes it from the unclipped range; the gradient passes straight through the rounding of
    ``W / s + V`` and of the scale (to the continuous ``max(alpha max W, -beta min W) / m``). At ``V = 0``,
    ``alpha = beta = 1`` the result is :func:`~llmc_fsm_quantization.rtn.rtn_quantize`'s, bitwise.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        args: QuantizationArgs,
        *,
        global_scale: torch.Tensor | None = None,
        scheme: QuantizationScheme | None = None,
    ) -> None:
        self.dtype = weight.dtype
        self.args = args
        self.scheme = scheme
        self.float = args.type == QuantizationType.FLOAT
        self.scaled = is_scaled_format(args)
        w = weight.detach().to(torch.float32)
        self.rows, self.cols = w.shape
        self.w = _grouped(w, args)
        self.shape = tuple(self.w.shape)
        self.lo = self.w.amin(dim=-1)
        self.hi = self.w.amax(dim=-1)
        self.row_args = as_row_args(args)
        q_min, q_max = calculate_range(self.row_args, w.device)
        self.q_min, self.q_max = float(q_min), float(q_max)
        self.global_scale = None
        if args.strategy == QuantizationStrategy.TENSOR_GROUP:  # NVFP4: its own unless one is shared (fused)
            self.global_scale = (
                (global_scale if global_scale is not None else fused_global_scale([weight]))
                .to(device=w.device, dtype=torch.float32)
                .reshape(1)
            )
        self.v = torch.zeros_like(self.w).requires_grad_()
        self.alpha = torch.ones_like(self.hi).requires_grad_()
        self.beta = torch.ones_like(self.lo).requires_grad_()
        #: symmetric integers after :meth:`search_range_`: per group, whether its first value of largest magnitude
        #: (in the group's order) is negative, i.e. maps to ``q_min`` (auto-round's ``search_scales``); ``None``:
        #: the side of larger magnitude, the maximum on a tie (its ``int_sym``).
        self.negative_first: torch.Tensor | None = None

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.v, self.alpha, self.beta]

    def qparams(self, *, final: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point ``[A, B]`` (:func:`_grouped`) from the clipped range (differentiable in the scale).

        Integers, symmetric: the whole range, the side of larger magnitude on ``q_min`` (signed scale, see the module
        docstring; ``|s| >= 1e-5`` as auto-round); asymmetric: compressed-tensors' ``calculate_qparams``. Floats: the
        effective scale (NVFP4: divided by the global scale) while tuning, the stored one when ``final``.
        """
        if self.float:
            return self._float_qparams(final=final)
        if self.row_args.symmetric:
            hi = self.hi.clamp(min=0) * self.alpha
            neg = -(self.lo.clamp(max=0) * self.beta)  # magnitude of the clipped minimum
            negative = hi < neg if self.negative_first is None else self.negative_first
            scale = torch.where(negative, neg, -hi) / -self.q_min
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

    def _float_qparams(self, *, final: bool) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.lo * self.beta, self.hi * self.alpha
        with torch.no_grad():  # as round-to-nearest computes them (observe_scaled_format / observe)
            if self.scaled:
                stored, zp = calculate_qparams(
                    lo.detach().to(self.dtype), hi.detach().to(self.dtype), self.args, global_scale=self.global_scale
                )
                stored = stored.to(torch.float32)
                if self.args.scale_dtype is None:
                    stored = storable(stored, self.dtype)
            else:
                stored, zp = calculate_qparams(lo.detach(), hi.detach(), self.row_args)
                stored = storable(stored, self.dtype)
        if final:
            return stored, zp
        exact = stored / self.global_scale if self.global_scale is not None else stored
        continuous = torch.maximum(hi, -lo) / self.q_max
        return continuous + (exact - continuous).detach(), zp

    def quantized(self, *, final: bool = False) -> torch.Tensor:
        """``W_hat`` ``[rows, cols]`` (float32; integers: ``round(W / s + V) + z`` clamped; floats: see the class)."""
        if self.float:
            return self._float_quantized(final=final)
        scale, zp = self.qparams(final=final)
        s, z = scale.unsqueeze(-1), zp.to(torch.float32).unsqueeze(-1)
        x = self.w / s + self.v
        q = (torch.round(x) if final else _round_ste(x)) + z
        q = q.clamp(self.q_min, self.q_max)
        return _ungrouped((q - z) * s, self.args, self.rows, self.cols)

    def _float_quantized(self, *, final: bool) -> torch.Tensor:
        if final:  # compressed-tensors' own rounding of W + V s (= W at V = 0: round-to-nearest, bitwise)
            with torch.no_grad():
                stored, zp = self.qparams(final=True)
                s = (stored / self.global_scale if self.global_scale is not None else stored).unsqueeze(-1)
                x = torch.where(self.v == 0, self.w, self.w + self.v * s)
                scale = stored.reshape(1) if self.args.strategy == QuantizationStrategy.TENSOR else stored
                return fake_quantize(
                    _ungrouped(x, self.args, self.rows, self.cols),
                    scale,
                    zp.reshape(scale.shape),
                    self.args,
                    global_scale=self.global_scale,
                ).to(torch.float32)
        s, _ = self.qparams()
        s = s.unsqueeze(-1)
        x = (self.w / s + self.v).clamp(self.q_min, self.q_max)
        with torch.no_grad():
            bounds = torch.tensor(self.q_min), torch.tensor(self.q_max)
            rounded = round_to_quantized_type_args(x.detach(), self.args, *bounds)
        return _ungrouped((x + (rounded - x).detach()) * s, self.args, self.rows, self.cols)

    @torch.no_grad()
    def clamp_(self) -> None:
        self.v.clamp_(-0.5, 0.5)
        self.alpha.clamp_(*CLIP_RANGE)
        self.beta.clamp_(*CLIP_RANGE)

    @torch.no_grad()
    def search_range_(self, importance: torch.Tensor, multipliers: Sequence[float]) -> None:
        """auto-round's optimized round-to-nearest: each group's range (``alpha = beta``) set to the multiplier of
        ``multipliers`` (:func:`optimized_rtn_multipliers`) whose weight, as the checkpoint stores it
        (:meth:`quantized` with ``final``), has the lowest ``sum_j imp_j (W_hat_j - W_j)^2`` over the group; the
        first multiplier that reaches it on a tie (auto-round replaces only on a strictly lower error). Symmetric
        integers: the value of largest magnitude that maps to ``q_min`` is the group's first one in its order when
        ``+m`` and ``-m`` both occur (:attr:`negative_first`, as ``search_scales`` takes ``argmax |W|``).

        Args:
            importance: ``[cols]`` float32, each input column's ``E[x^2]`` over the calibration tokens (any
                positive multiple of it); zeros replaced per group by :func:`importance_without_zeros`.
            multipliers: the candidates, in order.
        """
        imp = _grouped(importance.to(self.w.device, torch.float32).expand(self.rows, self.cols), self.args)
        imp = importance_without_zeros(imp, self.w, int(self.args.num_bits))
        if not self.float and self.row_args.symmetric:  # ties of the largest magnitude: the first value's side
            first = torch.take_along_dim(self.w, self.w.abs().argmax(dim=-1, keepdim=True), dim=-1).squeeze(-1)
            self.negative_first = first < 0
        best_loss, best = None, torch.ones_like(self.alpha)
        buffer = torch.empty_like(self.w)
        for m in multipliers:
            self.alpha.fill_(m)
            self.beta.fill_(m)
            if self.float:  # :meth:`quantized` at V = 0: compressed-tensors' rounding of W
                stored, zp = self.qparams(final=True)
                scale = stored.reshape(1) if self.args.strategy == QuantizationStrategy.TENSOR else stored
                w = _ungrouped(self.w, self.args, self.rows, self.cols)
                buffer = _grouped(
                    fake_quantize(w, scale, zp.reshape(scale.shape), self.args, global_scale=self.global_scale),
                    self.args,
                ).to(torch.float32)
            else:  # :meth:`quantized` at V = 0, in place: s * (clamp(round(W / s) + z) - z)
                scale, zp = self.qparams(final=True)
                s, z = scale.unsqueeze(-1), zp.to(torch.float32).unsqueeze(-1)
                torch.div(self.w, s, out=buffer)
                buffer.round_().add_(z).clamp_(self.q_min, self.q_max).sub_(z).mul_(s)
            loss = buffer.sub_(self.w).square_().mul_(imp).sum(dim=-1)
            if best_loss is None:
                best_loss = loss
                best.fill_(m)
                continue
            better = loss < best_loss
            best_loss = torch.where(better, loss, best_loss)
            best = torch.where(better, torch.full_like(best, m), best)
        self.alpha.copy_(best)
        self.beta.copy_(best)

    def snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def load(self, values: Sequence[torch.Tensor]) -> None:
        for p, value in zip(self.params, values, strict=True):
            p.copy_(value)

    @torch.no_grad()
    def final_weight(self) -> torch.Tensor:
        """The weight a checkpoint of it reloads to, in the weight's dtype: NVFP4 / MX / FP8-block weights as
        :func:`~llmc_fsm_quantization._base.attach_qparams` leaves a module holding :meth:`result` (packed and
        dequantized by compressed-tensors' compressor of the format; MX and NVFP4 dequantize in bfloat16), the
        others as :meth:`quantized` gives them."""
        quantized = self.result()
        if not self.scaled or self.scheme is None:
            return quantized.weight
        module = torch.nn.utils.skip_init(
            nn.Linear, self.cols, self.rows, bias=False, dtype=self.dtype, device=self.w.device
        )
        module.weight.data = quantized.weight.clone()
        attach_qparams(module, self.scheme.model_copy(deep=True), quantized)
        return module.weight.data

    @torch.no_grad()
    def result(self) -> QuantizedWeight:
        scale, zp = self.qparams(final=True)
        if self.args.strategy == QuantizationStrategy.TENSOR:
            scale, zp = scale.reshape(1), zp.reshape(1)
        return QuantizedWeight(
            weight=self.quantized(final=True).to(self.dtype), scale=scale, zero_point=zp, global_scale=self.global_scale
        )


def _rows(value: Any, rows: int, index: torch.Tensor) -> Any:
    """``value`` with every tensor whose first dimension is the batch (``rows``) restricted to ``index``."""
    if isinstance(value, torch.Tensor):
        return value[index] if value.dim() > 0 and value.shape[0] == rows and rows > 1 else value
    if isinstance(value, tuple | list):
        return type(value)(_rows(v, rows, index) for v in value)
    if isinstance(value, dict):
        return {k: _rows(v, rows, index) for k, v in value.items()}
    return value


def _multipliers(name: str, args: QuantizationArgs) -> list[float]:
    """:func:`optimized_rtn_multipliers` of target ``name``'s weights.

    Raises:
        ValueError: its weights have none.
    """
    multipliers = optimized_rtn_multipliers(args)
    if multipliers is None:
        msg = f"{name}: its weights have no optimized round-to-nearest (asymmetric integers, FP8)"
        raise ValueError(msg)
    return multipliers


def input_quantizer(
    args: QuantizationArgs,
    *,
    scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x`` quantized and dequantized as compressed-tensors' quantized forward does to a Linear's input
    (``forward_quantize``): dynamic ``args`` (per token, per group, NVFP4's ``local``) take their scales from ``x``
    (``compute_dynamic_scales_and_zp``, under ``global_scale`` for NVFP4), static ones the calibrated ``scale`` /
    ``zero_point`` ``[1]``; in ``x``'s dtype, with the gradient passed straight through (so the layer is tuned with
    its Linears' inputs as the quantized model computes them)."""

    def quantize(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            value = x.detach()
            if args.dynamic in (True, DynamicType.LOCAL):
                s, z = compute_dynamic_scales_and_zp(value, args, None, global_scale=global_scale)
            else:
                s, z = scale.to(value.dtype), zero_point
            q = _library_fake_quantize(value, s, z, args, global_scale=global_scale).to(value.dtype)
        return x + (q - x).detach()

    return quantize


def signround_layer(
    layer: nn.Module,
    targets: dict[str, nn.Module],
    inputs: Inputs,
    outputs: list[torch.Tensor],
    *,
    args: QuantizationArgs | Mapping[str, QuantizationArgs],
    iters: int = 200,
    lr: float | None = None,
    batch_size: int = 8,
    seed: int = SEED,
    global_scales: Mapping[str, torch.Tensor] | None = None,
    schemes: Mapping[str, QuantizationScheme] | None = None,
    input_quantizers: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    importance: Mapping[str, torch.Tensor] | None = None,
    measure: bool = True,
) -> tuple[dict[str, QuantizedWeight], LayerErrors]:
    """Quantize ``targets`` of ``layer`` with SignRound on the layer's output error (see the module docstring).

    Args:
        layer: the decoder layer (its weights are not modified here).
        targets: ``{name relative to layer: Linear}`` to quantize; a fused experts module's matrices as
            :class:`~llmc_fsm.toolkit.LinearView` s (``mlp.experts.3.gate_proj``), all of its parameter's matrices:
            the layer then runs with that parameter rebuilt from their quantized matrices at every step.
        inputs: per calibration batch, the layer's ``(args, kwargs)``; ``args[0]`` is ``[B, L, hidden]``.
        outputs: per batch, the target hidden states (the modifier gives the float model's output of the layer).
        args: the weights' ``QuantizationArgs``, one for all targets or ``{name: args}``: integers (tensor,
            channel or group strategy) or floats (FP8 per tensor, channel or block; NVFP4; MXFP4 / MXFP8).
        iters: signed-gradient steps; ``0``: none (round-to-nearest on the same grid, auto-round's RTN mode).
        lr: step size of ``V``, ``alpha`` and ``beta``; default ``1 / iters`` (auto-round's).
        batch_size: calibration samples (rows of the batches) per step.
        seed: seed of the random choice of samples.
        global_scales: NVFP4 targets: ``{name: [1] float32}`` the global scale shared with the modules a serving
            engine fuses (default: each weight's own).
        schemes: ``{name: QuantizationScheme}``; NVFP4 / MX / FP8-block targets named here are measured, in the
            errors reported, with the weight their checkpoint reloads to (:meth:`_Tuned.final_weight`).
        input_quantizers: ``{name: function}`` applied to a (Linear) target's input in every forward of the
            layer here (:func:`input_quantizer`): the scheme's input activations.
        importance: with ``iters: 0``, auto-round's optimized round-to-nearest for the targets named: ``{name:
            [in_features] float32}`` each input column's ``E[x^2]`` over the calibration tokens; each group's range
            is searched (:meth:`_Tuned.search_range_` over :func:`optimized_rtn_multipliers`), and the errors are
            round-to-nearest's (``rtn``) and the searched ranges' (``tuned``), ``kept`` ``"opt_rtn_mode"``.
        measure: with ``iters: 0``, whether the layer's output errors are measured (two forwards of the layer over
            every calibration sample); ``False``: :class:`LayerErrors` with ``None`` errors, and ``inputs`` /
            ``outputs`` are not read (they may be empty).

    Returns:
        ``{name: QuantizedWeight}`` (dequantized weight in the weight's dtype, scale, zero point, NVFP4's global
        scale) and the layer's :class:`LayerErrors`.

    Raises:
        ValueError: a target's weight does not divide into the scheme's groups or blocks; ``importance`` for a
            target whose weights have no optimized round-to-nearest (:func:`optimized_rtn_multipliers`), or with
            ``iters >= 1``.
    """
    importance = importance or {}
    if importance and iters:
        raise ValueError("importance (optimized round-to-nearest) is for iters: 0 only")
    lr = (1.0 / iters if iters else 0.0) if lr is None else float(lr)
    schemes = schemes or {}
    global_scales = global_scales or {}
    tuned = {
        name: _Tuned(
            m.weight,
            args[name] if isinstance(args, Mapping) else args,
            global_scale=global_scales.get(name),
            scheme=schemes.get(name),
        )
        for name, m in targets.items()
    }
    params = [p for t in tuned.values() for p in t.params]
    samples = [(b, r) for b, (a, _) in enumerate(inputs) for r in range(a[0].shape[0])]
    gen = torch.Generator().manual_seed(seed)

    owners = {id(m): n for n, m in layer.named_modules()}

    def quantized_weights(final: bool) -> dict[str, torch.Tensor]:
        """The layer's parameters to call it with: each target's quantized weight; a fused experts parameter
        rebuilt from its matrices' (every matrix of it is a target: the copy's values are all replaced)."""
        weights: dict[str, torch.Tensor] = {}
        for name, t in tuned.items():
            module, w = targets[name], (t.final_weight() if final else t.quantized().to(t.dtype))
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

    handles = [
        targets[name].register_forward_pre_hook(lambda module, a, _q=quantize: (_q(a[0]), *a[1:]))
        for name, quantize in (input_quantizers or {}).items()
        if not isinstance(targets[name], LinearView)
    ]
    try:
        rtn = full_error(final=True) if iters or measure else None
        if not iters:  # round-to-nearest mode: each group's range searched where importance is given
            for name, imp in importance.items():
                tuned[name].search_range_(imp, _multipliers(name, tuned[name].args))
            searched = full_error(final=True) if measure and importance else rtn
            kept = "opt_rtn_mode" if importance else "rtn_mode"
            return {name: t.result() for name, t in tuned.items()}, LayerErrors(rtn=rtn, tuned=searched, kept=kept)
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
    finally:
        for handle in handles:
            handle.remove()
    kept = "autoround"
    if not tuned_error < rtn:
        kept = "rtn"
        for t in tuned.values():
            t.load([torch.zeros_like(t.v), torch.ones_like(t.alpha), torch.ones_like(t.beta)])
    return {name: t.result() for name, t in tuned.items()}, LayerErrors(rtn=rtn, tuned=tuned_error, kept=kept)


# --------------------------------------------------------------------------- the modifier
def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{attribute.name} must be a positive int, got {value!r}"
        raise ValueError(msg)


def _iters(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        msg = f"iters must be an int >= 0 (0: auto-round's round-to-nearest mode), got {value!r}"
        raise ValueError(msg)


def _lr(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if value is not None and (not number or not math.inf > value > 0):
        msg = f"lr must be a finite positive number or null (1 / iters), got {value!r}"
        raise ValueError(msg)


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        msg = f"{attribute.name} must be true or false, got {value!r}"
        raise ValueError(msg)


def _device_ids(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, str | int)):
        msg = f"device_ids must be a device string such as '0,1' (llm-compressor's device map) or null, got {value!r}"
        raise ValueError(msg)


#: Weight strategies SignRound tunes here (one scale per tensor, row, group, NVFP4 group or FP8 block).
_TUNED_STRATEGIES = (
    QuantizationStrategy.TENSOR,
    QuantizationStrategy.CHANNEL,
    QuantizationStrategy.GROUP,
    QuantizationStrategy.TENSOR_GROUP,
    QuantizationStrategy.BLOCK,
)


def _scheme_problem(scheme: QuantizationScheme) -> str | None:
    """Why AutoRound does not tune ``scheme``, or ``None``: it needs weights, of a strategy in
    :data:`_TUNED_STRATEGIES`, and no output activations (compressed-tensors' Linear forward quantizes those after
    the product; auto-round has no such mode)."""
    w = scheme.weights
    if w is None:
        return "the scheme quantizes no weights"
    if scheme.output_activations is not None:
        return "the scheme quantizes output activations, which AutoRound does not tune with"
    if w.strategy not in _TUNED_STRATEGIES:
        names = ", ".join(str(s.value) for s in _TUNED_STRATEGIES)
        return f"weight strategy {getattr(w.strategy, 'value', w.strategy)} is not tuned ({names} are)"
    return None


def optimized_rtn_multipliers(args: QuantizationArgs) -> list[float] | None:
    """The range multipliers auto-round's optimized round-to-nearest tries for weights ``args`` (``iters: 0``
    without ``disable_opt_rtn``), in its order, the first ``1`` (plain round-to-nearest); ``None`` where auto-round
    rounds plainly (asymmetric integers, FP8). Each group's scale is that of its range times the multiplier that
    gives the lowest importance-weighted squared error (:meth:`_Tuned.search_range_`).

    * symmetric integers of ``b`` bits (``opt_rtn_int_sym``, its ``search_scales``; from llama.cpp): the value of
      largest magnitude ``w_max`` maps to ``-(n - step * i)`` with ``n = 2^(b-1)``, i.e. the scale is
      ``-w_max / (n - step * i)``, for ``i`` in ``-100..100`` and ``step = 0.0075 n`` (``0.75 n`` each side in
      200 steps); 2 bits: ``i`` in ``-90..90``, ``step = 0.01``. Multiplier ``n / (n - step * i)``, from
      ``4 / 7`` to ``4`` (1.75 n down to 0.25 n).
    * NVFP4 (``opt_rtn_nv_fp4``, ``search_nvfp4_scale``): ``0.50, 0.51, ..., 1.51`` of each group's maximum.
    * MXFP4 / MXFP8 (``opt_rtn_mx_fp``, ``search_mx_scale``): ``0.5`` and ``2``, i.e. each group's power-of-two
      scale one step down or up.

    Source: intel/auto-round 0.15.1, ``auto_round/data_type/int.py``, ``nvfp.py``, ``mxfp.py`` (the newest that
    llm-compressor 0.14.0.1 installs, ``auto-round<=0.15.1``; 0.14.2 has the integer search only).
    """
    kind = str(getattr(args.type, "value", args.type))
    if kind == "int" and args.symmetric:
        n = 2.0 ** (int(args.num_bits) - 1)
        step, reach = (0.01, 90) if int(args.num_bits) == 2 else (0.0075 * n, 100)
        order = [0, *range(-reach, 0), *range(1, reach + 1)]
        return [n / (n - step * i) for i in order]
    if is_nvfp4(args):
        return [1.0] + [v / 100 for v in range(50, 152) if v != 100]
    if kind == "float" and args.strategy == QuantizationStrategy.GROUP and args.scale_dtype is not None:  # MX
        return [1.0, 0.5, 2.0]
    return None


def importance_without_zeros(importance: torch.Tensor, w: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``importance`` ``[..., n]`` (per group of ``n`` weights ``w``, same shape) with its zeros replaced as
    auto-round's ``_imatrix_handle_zero`` (from llama.cpp) does before its search, when some entry is exactly
    zero: a group whose inputs were zero (at most ``1e-30``) on more than half its columns takes ``|w|``
    (``num_bits <= 3``) or ``|w| + sqrt(sum(w^2) / 32)`` instead; one with fewer such columns fills its exact zeros
    with the mean of the group's other values. (auto-round counts half of the group size, and of ``-1`` for a
    channel: every row of a channel-wise weight then takes the fallback as soon as one input is zero; here half of
    each group's columns.)
    """
    if not bool((importance == 0).any()):
        return importance
    zeros = (importance <= 1e-30).sum(dim=-1, keepdim=True)
    n = importance.shape[-1]
    if num_bits <= 3:
        fallback = w.abs()
    else:
        fallback = w.abs() + (w.pow(2).sum(dim=-1, keepdim=True) / 32).sqrt()
    mean = importance.sum(dim=-1, keepdim=True) / (n - zeros).clamp(min=1)
    filled = torch.where((importance == 0) & (zeros > 0), mean, importance)
    return torch.where(zeros > n // 2, fallback, filled)


@attrs.define(kw_only=True, slots=False, eq=False)
class AutoRoundModifier(QuantizingModifier):
    """Quantize Linear weights with AutoRound (SignRound): rounding and clipping tuned per decoder layer.

    Args (llm-compressor's names and defaults; besides ``scheme``, ``config_groups``, ``targets``, ``ignore``):
        iters: signed-gradient steps per decoder layer (default 200); ``0`` is auto-round's round-to-nearest mode:
            no tuning, each weight rounded to nearest on the grid above (floats: compressed-tensors' own
            round-to-nearest), with each group's range searched where auto-round searches it (see
            ``disable_opt_rtn``).
        lr: step size (default ``null``: ``1 / iters``, as auto-round).
        batch_size: calibration samples per step (default 8).
        enable_torch_compile: accepted (default true) and has no effect: the tuning loop is not compiled.
        disable_opt_rtn: with ``iters: 0`` (default false, as llm-compressor): auto-round's optimized
            round-to-nearest for symmetric integer, NVFP4 and MX weights: each group's range multiplied by the
            candidate of :func:`optimized_rtn_multipliers` with the lowest squared error weighted by each input
            column's ``E[x^2]`` over the calibration tokens (observed in the calibration pass; a fused expert
            matrix's over the tokens routed to its expert, all of them with ``calibrate_all_experts``, and the
            unweighted error for an expert that got none). ``true``, or any other scheme: plain round-to-nearest.
            No effect with ``iters >= 1``.
        device_ids: accepted (llm-compressor hands it to auto-round as the devices a layer's tuning is spread
            over); a warning says it is not used: each decoder layer is tuned on the device it is on, with the same
            result.

    Schemes (one per config group, each tuned on the layer's output error together): integer weights (tensor,
    channel or group strategy, symmetric or not: ``W4A16``, ``W8A16``, ``W8A8``, ...) and float ones (``FP8``,
    ``FP8_DYNAMIC``, ``FP8_BLOCK``, ``NVFP4``, ``NVFP4A16``, ``MXFP4``, ``MXFP8``, ...; :class:`_Tuned`). Input
    activations are quantized while tuning as the quantized model quantizes them (:func:`input_quantizer`):
    dynamic ones from each input, static ones (``FP8``) and NVFP4's input global scale from the ranges the
    calibration pass observed on the layer's inputs before it is tuned (as every quantizing modifier observes
    them; not on fused experts, whose inputs are not quantized in memory). ``observer`` must be ``minmax``
    or, equal on weights, ``static_minmax`` / ``memoryless_minmax`` (AutoRound tunes the range itself).
    Requires state ``model`` and ``calibration_data``; runs in one process. Memory: the current layer's inputs, its
    output on them and the float model's hidden states before and after it, for every calibration sample, and three
    tensors per weight (``V``, and per group ``alpha``, ``beta``).
    After the run :attr:`layer_errors` holds each layer's :class:`LayerErrors` (the one-shot report's ``tuning``
    section, :attr:`tuning_results`; kept across ``--resume`` by :meth:`progress_state`).

    Raises (at construction): ``ValueError`` for an unsupported scheme or argument.
    """

    #: Under torch.distributed every rank tunes every module (its per-layer tuning state is not handed over).
    shares_work_across_ranks = False
    #: Fused experts: each expert matrix tuned with the layer's other targets (:func:`signround_layer`).
    compresses_views = True
    #: Its layer tuning keeps the layer's inputs and float outputs as the experts were: experts dropped by REAP in
    #: the same stage are refused (REAP in a stage before it works).
    follows_expert_drop = False

    iters: int = attrs.field(default=200, validator=_iters)
    lr: float | None = attrs.field(default=None, validator=_lr)
    batch_size: int = attrs.field(default=8, validator=_positive_int)
    enable_torch_compile: bool = attrs.field(default=True, validator=_bool)
    disable_opt_rtn: bool = attrs.field(default=False, validator=_bool)
    device_ids: str | None = attrs.field(default=None, validator=_device_ids)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for group, scheme in self._groups.items():
            problem = _scheme_problem(scheme)
            if problem is not None:
                where = f"config group {group!r}: " if self.config_groups is not None else ""
                msg = f"AutoRoundModifier: {where}{problem}; use GPTQModifier or QuantizationModifier for that scheme"
                raise ValueError(msg)
        observers = sorted({s.weights.observer for s in self._groups.values() if s.weights is not None})
        other = [o for o in observers if o not in _RANGE_OBSERVERS]
        if other:
            msg = (
                "AutoRoundModifier tunes the weight range itself: observer must be minmax (or its equivalents for "
                f"weights, static_minmax and memoryless_minmax), got {other[0]!r}"
            )
            raise ValueError(msg)
        if self.device_ids is not None:
            logger.warning(
                "AutoRoundModifier: device_ids %r is not used: each decoder layer is tuned on the device it is on "
                "(the result is the same; only llm-compressor's spreading of a layer over several GPUs is not done)",
                self.device_ids,
            )
        #: decoder layer name -> :class:`LayerErrors`, in the order the layers were tuned.
        self.layer_errors: dict[str, LayerErrors] = {}
        self._layers: dict[int, tuple[str, nn.Module]] = {}
        self._captured: dict[int, tuple[Inputs, list[torch.Tensor]]] = {}
        self._done: set[int] = set()  # layers tuned: the pipeline's propagation through them is not captured
        #: per calibration batch, the float model's hidden states entering the next layer (``None``: the same as
        #: the pipeline's, before the first layer)
        self._float_hidden: list[torch.Tensor] | None = None
        self._output_hooks: list[Any] = []  # torch handles of the layers' output hooks, while outputs are captured
        self._tokens: dict[int, int] = {}  # iters: 0: calibration tokens per layer key (nothing else is captured)

    @property
    def optimized_rtn(self) -> bool:
        """Whether the weights are rounded with auto-round's optimized round-to-nearest: ``iters: 0`` without
        ``disable_opt_rtn``, on a scheme that has one (:func:`optimized_rtn_multipliers`); the targets' inputs
        are then observed in the calibration pass (their ``E[x^2]`` per column)."""
        return (
            self.iters == 0
            and not self.disable_opt_rtn
            and any(optimized_rtn_multipliers(s.weights) is not None for s in self._groups.values())
        )

    @property
    def needs_importance(self) -> bool:
        """:attr:`QuantizingModifier.needs_importance`, or :attr:`optimized_rtn`."""
        return super().needs_importance or self.optimized_rtn

    @property
    def _observes_targets(self) -> bool:
        """Whether the targets are hooked in the calibration pass: calibrated input scales, or the importance of
        :attr:`optimized_rtn`."""
        return self.calibrated_inputs or self.optimized_rtn

    # ---- hooks --------------------------------------------------------------------------------
    def on_initialize(self, state: Any) -> None:
        super().on_initialize(state)
        name, layers = find_decoder_layers(state.model)
        self.layer_errors = {}
        # every decoder layer, also one without targets: the float model's hidden states go through each
        self._layers = {id(layer): (f"{name}.{i}", layer) for i, layer in enumerate(layers)}

    def check_model(self, model: nn.Module) -> dict[str, nn.Module]:
        """:meth:`QuantizingModifier.check_model`; and targets outside the decoder layers are refused (AutoRound
        tunes a decoder layer on its output), and torch.distributed (it runs in one process): one line, before any
        work (the latter was refused at calibration start, after loading and data preparation: found by a tester).

        Raises:
            ValueError: as the base class, such targets, or several processes.
        """
        if is_distributed():
            raise ValueError(ONE_PROCESS)
        targets = super().check_model(model)
        name, layers = find_decoder_layers(model)
        inside = {id(v) for m in layers.modules() for v in (m, *weight_views(m).values())}  # fused experts' views
        outside = [n for n, m in targets.items() if id(m) not in inside]
        if outside:
            msg = (
                f"AutoRoundModifier tunes decoder layers; {', '.join(outside[:5])} lie outside {name}: add them to "
                "ignore"
            )
            raise ValueError(msg)
        return targets

    def on_calibration_start(self, state: Any) -> None:
        """Hook every decoder layer: its inputs (and, until the float model's hidden states are carried, its
        outputs) are captured. With calibrated input scales the targets are hooked too (their input ranges), and
        every layer keeps a forward hook that does nothing, so that the pipeline runs it in the plain order
        (calibrate, compress, propagate through the compressed layer: :func:`llmc_fsm.pipeline.layer.compress_layer`)
        past the first layer too, where the output hooks are gone: its grouped order would hand the next layer the
        outputs of this one's untuned weights, since the tuning compresses the whole layer at once."""
        if is_distributed():  # a session driven by hand (one-shot refuses it in check_model)
            raise ValueError(ONE_PROCESS)
        self._float_hidden = None
        self._output_hooks = []
        self._tokens = {}
        for key, (_, layer) in self._layers.items():
            if self.iters:  # the tuning's inputs and targets
                self.register_hook(layer, self._capture_input(key), kind="forward_pre", with_kwargs=True)
                self._output_hooks.append(self.register_hook(layer, self._capture_output(key), kind="forward"))
            else:  # nothing is tuned: only the calibration tokens are counted
                self.register_hook(layer, self._count_tokens(key), kind="forward_pre", with_kwargs=True)
        if self._observes_targets:  # the targets' inputs observed in the calibration pass (static scales, E[x^2])
            CalibratedModifier.on_calibration_start(self, state)
        if self._observes_targets:  # each expert matrix's inputs: its routed tokens (calibrate_all_experts: all),
            self._observe_views(state.model)  # for E[x^2] and static input ranges
        if self._observes_targets or not self.iters:
            for _, layer in self._layers.values():  # the plain order, also past the first layer (see the docstring)
                self.register_hook(layer, _observed_whole, kind="forward")

    def _capture_input(self, key: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if key in self._done:
                return
            if not args and "hidden_states" in kwargs:
                kwargs = dict(kwargs)
                args = (kwargs.pop("hidden_states"),)
            self._captured.setdefault(key, ([], []))[0].append((tuple(args), dict(kwargs)))

        return hook

    def _count_tokens(self, key: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if key not in self._done:
                hidden = args[0] if args else kwargs["hidden_states"]
                self._tokens[key] = self._tokens.get(key, 0) + int(hidden.shape[0] * hidden.shape[1])

        return hook

    def _capture_output(self, key: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            # past the first layer the target is the float model's output (:meth:`_float_outputs`), not this one
            if key not in self._done and self._float_hidden is None:
                self._captured.setdefault(key, ([], []))[1].append(first_output(output).detach())

        return hook

    def on_sequential_epoch_end(self, state: Any, modules: Any) -> None:
        roots = [modules] if isinstance(modules, nn.Module) else list(modules)
        layers = [sub for root in roots for sub in root.modules() if id(sub) in self._layers]
        for layer in layers:
            if id(layer) in self._captured or id(layer) in self._tokens:
                self._tune(*self._layers[id(layer)], id(layer))
        if layers:  # targets of these layers that saw no calibration input: listed in skipped
            super().on_sequential_epoch_end(state, layers)

    def on_calibration_end(self, state: Any) -> None:
        self._captured.clear()
        self._tokens.clear()
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
        kwargs)`` with the hidden states ``[B, L, hidden]`` first (kept for the tuning's targets; not with
        ``iters: 0``)."""
        if self.iters:
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
        """Quantize ``layer``'s targets: tuned on its captured inputs (``iters >= 1``), or rounded to nearest
        (``iters: 0``: no input is kept and no forward is run here, only the calibration pass's token count and,
        for the optimized round-to-nearest or static input scales, its statistics of the targets' inputs)."""
        self._done.add(key)
        tokens = self._tokens.pop(key, 0)
        inputs: Inputs = []
        outputs: list[torch.Tensor] = []
        if self.iters:
            inputs, outputs = self._captured.pop(key)
            if self._float_hidden is None and len(inputs) != len(outputs):  # a forward stopped early
                msg = f"AutoRoundModifier: {layer_name} ran {len(inputs)} times but returned {len(outputs)} outputs"
                raise RuntimeError(msg)
            outputs = self._float_outputs(layer, inputs, outputs)
            tokens = sum(int(a[0].shape[0] * a[0].shape[1]) for a, _ in inputs)
        ids = {id(m) for m in self._targets.values()}
        rel = {
            f"{n}.{suffix}" if suffix else n: sub
            for n, m in layer.named_modules()
            for suffix, sub in ((None, m), *weight_views(m).items())
            if id(sub) in ids and self._names_by_id[id(sub)] not in self.results
        }
        names = {n: self._names_by_id[id(m)] for n, m in rel.items()}
        if self._observes_targets:  # a Linear the calibration pass never reached has no input statistics: skipped
            rel = {
                n: m
                for n, m in rel.items()
                if isinstance(m, LinearView) or getattr(self._acc.get(names[n]), "num_samples", 0)
            }
        if not rel:
            return
        schemes = {n: self.scheme_of(names[n]) for n in rel}
        nvfp4 = [n for n in rel if is_nvfp4(schemes[n].weights)]
        shared = zip(nvfp4, self.global_scales([rel[n] for n in nvfp4]), strict=True)
        t0 = time.perf_counter()
        with own_forwards():  # no hook (this modifier's or another's of the same pass) takes these for calibration
            quantized, errors = signround_layer(
                layer,
                rel,
                inputs,
                outputs,
                args={n: scheme.weights for n, scheme in schemes.items()},
                iters=self.iters,
                lr=self.lr,
                batch_size=self.batch_size,
                global_scales={n: g for n, g in shared if g is not None},
                schemes=schemes,
                input_quantizers=self._input_quantizers(rel, names, schemes),
                importance={
                    n: self._importance(names[n], m)
                    for n, m in rel.items()
                    if self.optimized_rtn and optimized_rtn_multipliers(schemes[n].weights) is not None
                },
                measure=bool(self.iters),
            )
        self.layer_errors[layer_name] = errors
        if errors.rtn is None:
            logger.info("AutoRoundModifier: %s %s, %.1f s", layer_name, errors.kept, time.perf_counter() - t0)
        else:
            logger.info(
                "AutoRoundModifier: %s output MSE %.4g (round-to-nearest %.4g), kept %s, %.1f s",
                layer_name,
                errors.tuned,
                errors.rtn,
                errors.kept,
                time.perf_counter() - t0,
            )
        results = {id(rel[n]): q for n, q in quantized.items()}
        tunings: dict[int, _Tuning] = {}  # one per input statistics: the static input scales are computed from it
        for n in rel:
            stats = self._acc.get(names[n])
            if id(stats) not in tunings:
                ranges, dtype = getattr(stats, "ranges", None), getattr(stats, "dtype", None)
                tunings[id(stats)] = _Tuning(quantized=results, num_samples=tokens, ranges=ranges, dtype=dtype)
            self._acc[names[n]] = tunings[id(stats)]
        self._compress_all({names[n]: m for n, m in rel.items()})

    def _importance(self, name: str, module: nn.Module) -> torch.Tensor:
        """Target ``name``'s per-column ``E[x^2]`` over its calibration inputs (``[in_features]``), for the optimized
        round-to-nearest; an expert matrix the router sent no token has none and takes ones (auto-round, without
        an imatrix, searches the unweighted error)."""
        stats = self._acc.get(name)
        if stats is None or not getattr(stats, "num_samples", 0):
            return torch.ones(module.weight.shape[1])
        return importance_from_diagonal(stats.diagonal)

    def _input_quantizers(
        self, rel: dict[str, nn.Module], names: dict[str, str], schemes: dict[str, QuantizationScheme]
    ) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """For each Linear target whose scheme quantizes its input, the :func:`input_quantizer` the quantized model
        applies: static scales and NVFP4's input global scale from the ranges the calibration pass observed
        (computed as :meth:`QuantizingModifier._compress_group` then stores them)."""
        quantizers = {}
        for n, module in rel.items():
            scheme = schemes[n]
            args = scheme.input_activations
            if args is None or isinstance(module, LinearView):
                continue
            stats = self._acc.get(names[n])
            if _static_inputs(scheme):
                scale, zero_point = _input_qparams(scheme, stats)
                quantizers[n] = input_quantizer(args, scale=scale, zero_point=zero_point)
            elif is_local(args):
                quantizers[n] = input_quantizer(args, global_scale=_input_global_scale(scheme, stats))
            else:
                quantizers[n] = input_quantizer(args)
        return quantizers

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
            with own_forwards(), torch.no_grad():  # these forwards are not taken for calibration by any hook
                outputs = [
                    first_output(layer(hidden, *args[1:], **kwargs)).detach()
                    for hidden, (args, kwargs) in zip(self._float_hidden, inputs, strict=True)
                ]
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
        """With calibrated input scales or :attr:`optimized_rtn`, the targets' input ranges and the diagonal of
        their Hessian (:meth:`QuantizingModifier._new_accumulator`); else none (the layer's inputs are captured
        whole, and no target is hooked)."""
        return super()._new_accumulator(module) if self._observes_targets else None

    def _record_routed(self) -> None:
        """Nothing: the experts' matrices are tuned on the decoder layer's output error, whatever tokens each
        expert was routed (no per-expert statistics are observed, so there are no routed counts to report)."""

    def _quantize(self, modules: list[nn.Module], accumulator: Any, args: Any) -> list[QuantizedWeight]:
        return [accumulator.quantized[id(m)] for m in modules]


@attrs.define
class _Tuning:
    """What a decoder layer's tuning produced, handed to :meth:`CalibratedModifier._compress_all` as the
    targets' accumulator (one per input statistics; ``ranges`` and ``dtype`` are those statistics', from which
    :meth:`QuantizingModifier._compress_group` computes static input scales)."""

    quantized: dict[int, QuantizedWeight]
    num_samples: int
    in_features: int = 0
    ranges: dict[str, torch.Tensor] | None = None
    dtype: torch.dtype | None = None
