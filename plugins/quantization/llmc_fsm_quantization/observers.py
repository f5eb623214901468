"""Weight observers: the scale and zero point of a weight (or of each of its rows / groups).

The names are llm-compressor's (0.14), with the meaning they have for a weight,
which is observed once:

* ``minmax``, ``static_minmax``, ``memoryless_minmax``: each group's minimum and
  maximum. llm-compressor's three differ only in how they combine *several*
  observations (a moving average, a running extreme, the last one); a weight is
  observed once, so all three give its minimum and maximum.
* ``mse``, ``memoryless_mse``: the range shrunk by a factor ``p`` in ``1, 0.99,
  ..., 0.81`` (``grid`` 100, ``int(0.2 * 100)`` = 20 steps), keeping per group the ``p``
  whose fake-quantized values have the smallest ``sum |x - q(x)|^2.4`` (the search
  of GPTQ's reference code, arXiv 2210.17323, and llm-compressor's MSE observer;
  every step is tried, llm-compressor may stop after 5 steps that improve no group).
* ``imatrix_mse``: the same search with every error weighted by the importance of
  its input column, ``E[x_j^2]`` over the calibration tokens (the "importance
  matrix" of llama.cpp, llama.cpp PR 4861, as llm-compressor's ``imatrix_mse``):
  ``sum_j imp_j |w_ij - q(w_ij)|^3`` with ``imp`` divided by its mean, ``p`` in
  ``1, 0.95, ..., 0.10`` (``grid`` 20, ``int(0.95 * 20)`` = 19 steps), stopping after 5 steps
  that improve no group. ``E[x_j^2]`` is half the diagonal of the Hessian
  ``H = (2/n) X^T X`` that :class:`llmc_fsm.toolkit.obs.HessianAccumulator` gathers, so it
  needs calibration data. Unlike llm-compressor (which then falls back to plain
  MSE) it also weights per-tensor scales. On NVFP4 weights (round-to-nearest only) the search is
  llm-compressor 0.14's (its ``_grid_search``): each 16-value group's range ``p * [lo, hi]`` (in the weight's
  dtype) is tried with an unrounded float32 group scale ``max|range| / 6`` and no global scale, the error
  ``sum_j imp_j |w_ij - q(w_ij)|^3``; the chosen ranges then give the global scale (``448 * 6`` over their largest
  magnitude, jointly over the modules vLLM fuses) and the FP8 group scales (:func:`imatrix_nvfp4_ranges`).

* ``nvfp4_expanded_mse`` (NVFP4 weights only): each 16-value group's range is searched from 1.8x the
  observed range down to 0.81x: ``p = 1.8 (1 - i / 200)`` for ``i = 0 .. 110`` (llm-compressor's defaults:
  ``expand`` 1.8, ``grid`` 200, ``maxshrink`` ``1 - 0.8 / 1.8``, every step tried), keeping per group the
  ``p`` whose NVFP4 values have the smallest ``sum |x - q(x)|^2.4``. The error is that of the format itself:
  the group scale rounded to FP8 under the weight's global scale (``448 * 6 / max|W|``, from the unexpanded
  range), as the checkpoint stores it. A range wider than the group's values lets its largest value fall
  between the FP4 grid's 4 and 6 (the "four over six" idea; llm-compressor PR 2950).

Static input scales (``input_activations`` with ``dynamic: false``, one scale per tensor) are observed on every
calibration batch (:class:`llmc_fsm_quantization._base.CalibrationStatistics`); ``mse`` and ``memoryless_mse`` there
search each batch's range as llm-compressor 0.14's activation MSE observers do (:func:`input_range_mse`).

Any other name is refused (:func:`check_observer`). Scale and zero point from a
range come from ``compressed_tensors.quantization.utils.calculate_qparams`` and
the rounding from ``compressed_tensors``' ``fake_quantize``, so the values match
what the checkpoint's compressor computes when it packs the weight. The range is
handed to ``calculate_qparams`` in the weight's dtype (:func:`qparam_dtype`), as
llm-compressor 0.14 observes a weight: for a bfloat16 / float16 weight ``hi - lo``,
the division by the grid's width and the zero point ``q_min - lo / scale`` are each
rounded to that dtype, so scale and zero point are those of llm-compressor, bitwise,
and the zero point is computed from the scale that is stored (until session 38 they
came from a float32 range, the scale rounded once to the weight's dtype afterwards:
a tester found 27% of a bfloat16 model's asymmetric int4 scales, and zero points,
differing from llm-compressor's).

Shapes (``W`` is ``[rows, cols]``): tensor strategy ``[1]``, channel
``[rows, 1]``, group ``[rows, cols // group_size]``.
"""

from __future__ import annotations

import attrs
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.utils import calculate_qparams

from llmc_fsm_quantization.rounding import fake_quantize

__all__ = [
    "FUSED_SIBLINGS",
    "IMPORTANCE_OBSERVERS",
    "INPUT_MSE_OBSERVERS",
    "NVFP4_OBSERVERS",
    "OBSERVERS",
    "as_row_args",
    "check_observer",
    "check_scaled_observer",
    "fused_global_scale",
    "imatrix_nvfp4_ranges",
    "importance_from_diagonal",
    "importance_from_hessian",
    "input_range_mse",
    "is_local",
    "is_nvfp4",
    "is_scaled_format",
    "observe",
    "observe_scaled_format",
    "qparam_dtype",
    "quantize_rows",
    "ranges_global_scale",
    "row_qparams",
    "storable",
    "unknown_observer",
]

#: Observer names the modifiers accept (llm-compressor's weight observers).
OBSERVERS = (
    "minmax",
    "static_minmax",
    "memoryless_minmax",
    "mse",
    "memoryless_mse",
    "imatrix_mse",
    "nvfp4_expanded_mse",
)
#: Observers only for NVFP4 weights (``tensor_group``, 4-bit float).
NVFP4_OBSERVERS = frozenset({"nvfp4_expanded_mse"})
#: Observers that weight the error by the calibration inputs' importance (they need calibration data).
IMPORTANCE_OBSERVERS = frozenset({"imatrix_mse"})
_MINMAX = frozenset({"minmax", "static_minmax", "memoryless_minmax"})


@attrs.frozen
class _Search:
    """A range-shrinking search: ``p = 1 - i / grid`` for ``i = 0 .. int(max_shrink * grid) - 1``, error
    ``sum (importance *) |x - q(x)|^norm`` per group; stop after ``patience`` steps improving no group (``None``:
    never)."""

    grid: int
    max_shrink: float
    norm: float
    patience: int | None


_SEARCHES = {
    "mse": _Search(grid=100, max_shrink=0.2, norm=2.4, patience=None),
    "memoryless_mse": _Search(grid=100, max_shrink=0.2, norm=2.4, patience=None),
    "imatrix_mse": _Search(grid=20, max_shrink=0.95, norm=3.0, patience=5),
}


#: ``nvfp4_expanded_mse``: ``p = EXPAND * (1 - i / grid)``, ``i = 0 .. int(max_shrink * grid) - 1``.
_NVFP4_EXPAND = 1.8
_NVFP4_SEARCH = _Search(grid=200, max_shrink=1 - 0.8 / 1.8, norm=2.4, patience=None)


#: Activation observers that search each batch's range (:func:`input_range_mse`).
INPUT_MSE_OBSERVERS = frozenset({"mse", "memoryless_mse"})


@torch.no_grad()
def input_range_mse(x: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """The range ``[lo, hi]`` (float64 ``[2]``) of one calibration batch ``x`` (``[..., hidden]``) whose per-tensor
    fake quantization has the smallest error: llm-compressor 0.14's activation ``mse`` observer on one batch.

    ``lo, hi`` = the batch's minimum and maximum times ``p = 1 - i / grid`` for ``i = 0 .. int(maxshrink * grid) - 1``
    (defaults: ``grid`` 100, ``maxshrink`` 0.2, so ``p`` from 1 to 0.81), error ``sum |x - q(x)|^norm`` (``norm`` 2.4)
    with scale and zero point from ``calculate_qparams`` and compressed-tensors' rounding; the first ``p`` of the
    smallest error is kept, and the search stops after ``patience`` (5) steps without a smaller one. The four values
    are read from ``args.observer_kwargs`` under llm-compressor's names. Computed in float32 on ``x``'s device.

    Source: the range search of GPTQ's reference code (Frantar et al., arXiv 2210.17323), as llm-compressor applies
    it to activations (``MovingAverageMSEObserver``; the moving average over batches is the caller's).
    """
    kwargs = args.observer_kwargs or {}
    grid, maxshrink = float(kwargs.get("grid", 100.0)), float(kwargs.get("maxshrink", 0.20))
    norm, patience = float(kwargs.get("norm", 2.4)), int(kwargs.get("patience", 5))
    observed = x.detach().to(torch.float32).reshape(-1, 1, x.shape[-1])
    token_args = args.model_copy(update={"strategy": QuantizationStrategy.TOKEN})
    lo, hi = torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))
    best = torch.full_like(lo, torch.finfo(lo.dtype).max)
    best_lo, best_hi = lo.clone(), hi.clone()
    still = 0
    for i in range(int(maxshrink * grid)):
        p = 1 - i / grid
        scale, zero_point = calculate_qparams(lo * p, hi * p, args)
        q = fake_quantize(observed, scale.unsqueeze(-1), zero_point.unsqueeze(-1), token_args).to(observed.dtype)
        err = torch.sum((q - observed).abs().pow(norm), dim=(0, -1))
        improved = err < best
        if bool(improved.any()):
            best[improved], best_lo[improved], best_hi[improved] = err[improved], lo[improved] * p, hi[improved] * p
            still = 0
        else:
            still += 1
            if still >= patience:
                break
    return torch.cat([best_lo, best_hi]).to(device="cpu", dtype=torch.float64)


def is_local(args: QuantizationArgs | None) -> bool:
    """Whether ``args`` are input activations with ``dynamic: local`` (NVFP4's: per-group scales computed at run time
    under a calibrated per-tensor global scale)."""
    return args is not None and str(getattr(args.dynamic, "value", args.dynamic)).lower() == "local"


def is_nvfp4(args: QuantizationArgs) -> bool:
    """Whether ``args`` are NVFP4 weights: ``tensor_group`` strategy, 4-bit float."""
    kind = str(getattr(args.type, "value", args.type))
    return args.strategy == QuantizationStrategy.TENSOR_GROUP and kind == "float" and args.num_bits == 4


def check_observer(name: object) -> str:
    """``name`` if it is an observer the modifiers have.

    Raises:
        ValueError: ``unknown observer 'NAME'; choose one of minmax, static_minmax, ...`` (one line).
    """
    if not isinstance(name, str) or name not in OBSERVERS:
        raise ValueError(unknown_observer(name))
    return name


def unknown_observer(name: object) -> str:
    """``unknown observer 'NAME'; choose one of ...`` and, for a near miss (``difflib``), ``Did you mean 'X'?``."""
    import difflib

    close = difflib.get_close_matches(name, OBSERVERS, n=1) if isinstance(name, str) else []
    hint = f". Did you mean {close[0]!r}?" if close else ""
    return f"unknown observer {name!r}; choose one of {', '.join(OBSERVERS)}{hint}"


def importance_from_hessian(hessian: torch.Tensor) -> torch.Tensor:
    """Per-input-column importance ``E[x_j^2]`` ``[in]`` float32 from ``H = (2/n) X^T X`` ``[in, in]``:
    :func:`importance_from_diagonal` of its diagonal.

    Raises:
        ValueError: ``H``'s diagonal holds a negative or non-finite value.
    """
    return importance_from_diagonal(torch.diagonal(hessian))


def importance_from_diagonal(diagonal: torch.Tensor) -> torch.Tensor:
    """Per-input-column importance ``E[x_j^2]`` ``[in]`` float32 from ``diag(H)`` ``[in]`` of ``H = (2/n) X^T X``
    (half of it), divided by its mean as ``imatrix_mse`` uses it (all zeros stay zeros).

    Raises:
        ValueError: the diagonal holds a negative or non-finite value.
    """
    imp = diagonal.to(torch.float32) / 2
    if not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
        msg = "imatrix_mse: the calibration inputs' mean squares are not finite and non-negative"
        raise ValueError(msg)
    return imp / (imp.mean() + torch.finfo(torch.float32).tiny)


def as_row_args(args: QuantizationArgs) -> QuantizationArgs:
    """``args`` with channel strategy: one scale per row of a ``[G, n]`` matrix of groups."""
    return args.model_copy(update={"strategy": QuantizationStrategy.CHANNEL, "group_size": None, "actorder": None})


def _groups(weight: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """``weight`` as ``[G, n]``: one row per scale."""
    rows, cols = weight.shape
    if args.strategy == QuantizationStrategy.TENSOR:
        return weight.reshape(1, -1)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return weight
    if args.strategy == QuantizationStrategy.GROUP:
        return weight.reshape(rows * (cols // args.group_size), args.group_size)
    msg = f"observer: strategy {args.strategy!r} is not supported (tensor, channel, group)"
    raise ValueError(msg)


def quantize_rows(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, row_args: QuantizationArgs
) -> torch.Tensor:
    """Fake-quantize ``x`` ``[G, n]`` with one ``scale``/``zero_point`` ``[G, 1]`` per row (channel ``row_args``)."""
    return fake_quantize(x, scale, zero_point, row_args)


def qparam_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight of ``dtype`` has its scale and zero point computed in: its own when it is a float type
    narrower than float32 (bfloat16, float16; compressed-tensors computes them from the observed range in the
    weight's dtype), else float32."""
    if dtype.is_floating_point and torch.finfo(dtype).bits < torch.finfo(torch.float32).bits:
        return dtype
    return torch.float32


def row_qparams(
    x: torch.Tensor,
    row_args: QuantizationArgs,
    observer: str,
    importance: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point ``[G, 1]`` of each row of ``x`` ``[G, n]`` (channel ``row_args``) by ``observer``.

    ``importance``: for ``imatrix_mse``, the weight of each entry's error, ``[G, n]`` or broadcastable to it.
    ``dtype``: the dtype the rows' ranges (each searched range ``p * [lo, hi]`` too) are handed to
    ``calculate_qparams`` in, which computes the scale and zero point in it (:func:`qparam_dtype` of the weight's
    dtype; float32: the computation of a float32 weight). The searches' errors are float32 sums.

    Returns:
        ``(scale, zero_point)``: the scale float32 (holding values of ``dtype``), the zero point in
        ``row_args.zp_dtype`` computed from that scale.

    Raises:
        ValueError: unknown observer, or ``imatrix_mse`` without ``importance``.
    """
    check_observer(observer)
    if observer in NVFP4_OBSERVERS:
        raise ValueError(f"observer {observer} is for NVFP4 weights (tensor_group, 4-bit float) only")
    lo = x.amin(dim=1, keepdim=True).to(dtype)
    hi = x.amax(dim=1, keepdim=True).to(dtype)
    scale, zp = _range_qparams(lo, hi, row_args)
    if observer in _MINMAX:
        return scale, zp
    if observer in IMPORTANCE_OBSERVERS and importance is None:
        msg = f"observer {observer} weights the error by the calibration inputs' importance: it needs calibration data"
        raise ValueError(msg)
    search = _SEARCHES[observer]
    weight = importance.to(torch.float32) if observer in IMPORTANCE_OBSERVERS else None  # type: ignore[union-attr]
    best = torch.full((x.shape[0], 1), float("inf"), dtype=torch.float32, device=x.device)
    stale = 0
    for i in range(int(search.max_shrink * search.grid)):  # p = 1 ... 1 - (steps - 1) / grid, as llm-compressor
        p = 1.0 - i / search.grid
        s, z = (scale, zp) if i == 0 else _range_qparams(lo * p, hi * p, row_args)
        err = (quantize_rows(x, s, z, row_args) - x).abs_().pow_(search.norm)
        if weight is not None:
            err.mul_(weight)
        err = err.sum(dim=1, keepdim=True)
        better = err < best
        best = torch.where(better, err, best)
        scale = torch.where(better, s, scale)
        zp = torch.where(better, z, zp)
        stale = 0 if bool(better.any()) else stale + 1
        if search.patience is not None and stale >= search.patience:
            break
    return scale, zp


def _range_qparams(lo: torch.Tensor, hi: torch.Tensor, row_args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``calculate_qparams`` of the range ``[lo, hi]`` (computed in its dtype), the scale as float32."""
    scale, zp = calculate_qparams(lo, hi, row_args)
    return scale.to(torch.float32), zp


def storable(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` (float32) rounded to the values a ``dtype`` parameter holds, still float32.

    compressed-tensors stores ``weight_scale`` in the weight's dtype; a bfloat16 / float16 model whose weights
    were rounded with the float32 scale would reload (from the rounded scale) as a different model. The sign is
    kept (AutoRound's symmetric scales may be negative); a magnitude below the dtype's smallest normal becomes it.
    """
    if not dtype.is_floating_point or torch.finfo(dtype).bits >= torch.finfo(scale.dtype).bits:
        return scale
    rounded = scale.to(dtype).to(scale.dtype)
    tiny = torch.finfo(dtype).tiny
    return torch.where(rounded < 0, rounded.clamp(max=-tiny), rounded.clamp(min=tiny))


@torch.no_grad()
def observe(
    weight: torch.Tensor, args: QuantizationArgs, observer: str = "minmax", *, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of ``weight`` for ``args`` (strategy tensor, channel or group).

    Args:
        weight: ``[rows, cols]`` float tensor (group strategy: ``cols`` divisible by ``group_size``).
        args: the weight's ``QuantizationArgs``.
        observer: one of :data:`OBSERVERS` (see the module docs).
        importance: ``[cols]`` importance of each input column (:func:`importance_from_hessian`); needed by
            ``imatrix_mse``, unused by the others.

    Returns:
        ``(scale, zero_point)`` shaped ``[1]`` / ``[rows, 1]`` / ``[rows, cols // group_size]``; scale float32
        holding values of ``weight``'s dtype (computed in it: :func:`qparam_dtype`), zero point in
        ``args.zp_dtype`` (symmetric: zeros), computed from that scale: compressed-tensors' ``calculate_qparams``
        of the (searched) range in the weight's dtype, bitwise.

    Raises:
        ValueError: unknown observer or strategy, ``cols`` not divisible by ``group_size``, or ``imatrix_mse``
            without ``importance`` (or with one of another size).
    """
    check_observer(observer)
    rows, cols = weight.shape
    if args.strategy == QuantizationStrategy.GROUP and cols % args.group_size:
        msg = f"in_features {cols} is not a multiple of group_size {args.group_size}"
        raise ValueError(msg)
    x = _groups(weight.detach().to(torch.float32), args)
    entry_importance = None
    if observer in IMPORTANCE_OBSERVERS and importance is not None:
        if importance.shape != (cols,):
            msg = f"imatrix_mse: importance has shape {tuple(importance.shape)}, expected ({cols},)"
            raise ValueError(msg)
        entry_importance = _groups(importance.to(x.device, torch.float32).expand(rows, cols), args)
    scale, zp = row_qparams(x, as_row_args(args), observer, entry_importance, dtype=qparam_dtype(weight.dtype))
    if args.strategy == QuantizationStrategy.TENSOR:
        return scale.reshape(1), zp.reshape(1)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return scale, zp
    return scale.reshape(rows, cols // args.group_size), zp.reshape(rows, cols // args.group_size)


def is_scaled_format(args: QuantizationArgs) -> bool:
    """Whether ``args`` is a format whose scales compressed-tensors derives in its own way: NVFP4
    (``tensor_group``: fp8 group scales under one fp32 global scale), the MX formats (power-of-two group scales,
    ``scale_dtype`` uint8) or FP8 block scales (``block``). :func:`observe_scaled_format` takes those."""
    return args.strategy in (QuantizationStrategy.TENSOR_GROUP, QuantizationStrategy.BLOCK) or (
        args.scale_dtype is not None
    )


#: Sibling modules (attribute names of one parent module) that vLLM loads as one fused layer: ``qkv_proj``,
#: ``gate_up_proj`` (also of each expert of a mixture of experts), DeepSeek's multi-latent attention
#: ``fused_qkv_a_proj``, and experts' ``w1`` / ``w3``. A fused NVFP4 layer has one ``weight_global_scale``, so
#: their NVFP4 weights share one (:func:`fused_global_scale`); llm-compressor 0.14 fuses the same sets.
FUSED_SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
)


@torch.no_grad()
def fused_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """The NVFP4 global scale ``[1]`` float32 that ``weights`` (each ``[rows_i, cols_i]``, one dtype) share:
    ``448 * 6 / max|W|`` over all their values (compressed-tensors' ``generate_gparam``: the FP8 E4M3 maximum
    times the FP4 E2M1 maximum over the joint absolute maximum, so that the largest group scale of any of them
    reaches 448; 1.0 when every value is zero), computed in the weights' dtype as compressed-tensors computes it
    from their range (bfloat16 weights: ``2688`` times the bfloat16 reciprocal of ``max|W|``, rounded to
    bfloat16, which is how torch divides a number by a bfloat16 tensor; llm-compressor 0.14's value). One weight:
    its own global scale.

    Raises:
        ValueError: ``weights`` is empty or of several dtypes.
    """
    from compressed_tensors.quantization.utils import generate_gparam

    if not weights or len({w.dtype for w in weights}) != 1:
        raise ValueError("fused_global_scale: give one or more weights of one dtype")
    device = weights[0].device
    absmax = torch.stack([w.detach().abs().amax().to(device) for w in weights]).amax()
    return generate_gparam(-absmax.reshape(1), absmax.reshape(1))


@torch.no_grad()
def ranges_global_scale(ranges: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The NVFP4 global scale ``[1]`` float32 of searched group ranges (each ``(lo, hi)``; several: the modules vLLM
    fuses): ``448 * 6`` over their largest magnitude (compressed-tensors' ``generate_gparam``), as llm-compressor
    0.14 takes it from its observers' (searched) statistics."""
    from compressed_tensors.quantization.utils import generate_gparam

    absmax = torch.stack([torch.maximum(-lo.amin(), hi.amax()).to(ranges[0][0].device) for lo, hi in ranges]).amax()
    return generate_gparam(-absmax.reshape(1), absmax.reshape(1))


@torch.no_grad()
def check_scaled_observer(observer: str, args: QuantizationArgs) -> None:
    """Whether :func:`observe_scaled_format` has ``observer`` for the NVFP4 / MX / FP8-block ``args``.

    Raises:
        ValueError: (one line) ``observer NAME is not implemented for FORMAT weights; use minmax ...``: only the
            minmax observers, and ``nvfp4_expanded_mse`` for NVFP4, are.
    """
    nvfp4 = is_nvfp4(args)
    if observer not in _MINMAX and not (nvfp4 and (observer in NVFP4_OBSERVERS or observer in IMPORTANCE_OBSERVERS)):
        msg = (
            f"observer {observer} is not implemented for {_format_name(args)} weights; use minmax (or "
            "static_minmax / memoryless_minmax, the same for a weight)"
            + ("; nvfp4_expanded_mse or imatrix_mse for NVFP4" if nvfp4 else "")
        )
        raise ValueError(msg)


@torch.no_grad()
def imatrix_nvfp4_ranges(
    weight: torch.Tensor, args: QuantizationArgs, importance: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``imatrix_mse``'s ranges of NVFP4 ``weight`` ``[rows, cols]``: per 16-value group the minimum and maximum
    ``p * [lo, hi]`` (``p = 1 - i / 20``, ``i = 0 .. 18``, stopping after 5 steps that improve no group) whose FP4
    values under the unrounded group scale ``max(|p lo|, |p hi|) / 6`` (float32, no global scale) have the smallest
    ``sum_j imp_j |w_j - q(w_j)|^3``, ``imp`` = ``importance`` ``[cols]`` / its mean (llm-compressor 0.14's
    ``imatrix_mse`` on ``tensor_group`` weights). Ranges ``[rows, cols // 16]`` in the weight's dtype.

    Raises:
        ValueError: ``importance`` of another size, or a group size that does not divide ``cols``.
    """
    rows, cols = weight.shape
    gs = int(args.group_size)
    if cols % gs:
        raise ValueError(f"in_features {cols} is not a multiple of group_size {gs}")
    if importance.shape != (cols,):
        raise ValueError(f"imatrix_mse: importance has shape {tuple(importance.shape)}, expected ({cols},)")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as library_fake_quantize

    search = _SEARCHES["imatrix_mse"]
    plain = args.model_copy(update={"scale_dtype": None})  # unrounded group scales, as llm-compressor searches
    per_group = plain.model_copy(update={"strategy": QuantizationStrategy.TOKEN})  # one scale per group row
    groups = weight.detach().reshape(rows, cols // gs, gs)  # in the weight's dtype, as llm-compressor observes it
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    imp = importance.to(device=groups.device, dtype=torch.float32).reshape(cols // gs, gs)
    best = torch.full(lo.shape, float("inf"), dtype=torch.float32, device=groups.device)
    best_lo, best_hi = lo.clone(), hi.clone()
    stale = 0
    for i in range(int(search.max_shrink * search.grid)):  # p = 1 ... 1 - (steps - 1) / grid, as llm-compressor
        p = 1.0 - i / search.grid
        lo_p, hi_p = lo * p, hi * p
        scale, zp = calculate_qparams(lo_p, hi_p, plain)
        q = library_fake_quantize(groups, scale.unsqueeze(-1), zp.unsqueeze(-1), per_group).to(torch.float32)
        err = (q - groups.to(torch.float32)).abs_().pow_(search.norm).mul_(imp).sum(dim=2)
        better = err < best
        best = torch.where(better, err, best)
        best_lo, best_hi = torch.where(better, lo_p, best_lo), torch.where(better, hi_p, best_hi)
        stale = 0 if bool(better.any()) else stale + 1
        if stale >= search.patience:
            break
    return best_lo, best_hi


def observe_scaled_format(
    weight: torch.Tensor,
    args: QuantizationArgs,
    observer: str = "minmax",
    *,
    global_scale: torch.Tensor | None = None,
    ranges: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Scale, zero point and global scale of ``weight`` for NVFP4, MX or FP8-block ``args`` (minmax observers).

    Each group's (``tensor_group`` / MX: ``group_size`` inputs of a row; ``block``: a ``block_structure``
    ``[r, c]`` tile) minimum and maximum go through ``compressed_tensors.quantization.utils.calculate_qparams``,
    which makes the format's scales: NVFP4 ``scale = fp8(global * max|w_g| / 6)`` with
    ``global = 448 * 6 / max|W|`` (``generate_gparam``; ``global_scale`` when given, e.g. the one the modules
    vLLM fuses share: :func:`fused_global_scale`), so the effective scale is ``scale / global``; MX a power of
    two per group (E8M0 exponent); FP8 block ``max|w_b| / 448``.

    Returns:
        ``(scale, zero_point, global_scale)``: ``[rows, cols // group_size]`` or
        ``[ceil(rows / r), ceil(cols / c)]`` (float32; a partial block's scale from its values alone), the same
        shape in ``args.zp_dtype``, and ``[1]`` float32 for ``tensor_group`` else ``None``.

    ``ranges``: NVFP4 with ``imatrix_mse``: the groups' searched ``(lo, hi)`` (:func:`imatrix_nvfp4_ranges`), from
    which the scales (and, without ``global_scale``, the global scale) are computed.

    Raises:
        ValueError: an observer other than the minmax ones (the range-searching observers are not implemented
            for these formats), a group that does not divide the weight's input width, ``global_scale`` given for a
            format without one (not ``tensor_group``), or ``imatrix_mse`` without ``ranges``.
    """
    if global_scale is not None and args.strategy != QuantizationStrategy.TENSOR_GROUP:
        msg = f"a global scale was given for {_format_name(args)} weights, which have none (NVFP4 only)"
        raise ValueError(msg)
    check_scaled_observer(observer, args)
    rows, cols = weight.shape
    w = weight.detach().to(torch.float32)
    if args.strategy == QuantizationStrategy.BLOCK:  # a partial last block of rows / columns is padded with zeros,
        r, c = (int(v) for v in args.block_structure)  # which leave its max |w| as it is (llm-compressor's ceil)
        padded = torch.nn.functional.pad(w, (0, -cols % c, 0, -rows % r))
        tiles = padded.reshape(padded.shape[0] // r, r, padded.shape[1] // c, c)
        lo, hi = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    else:
        gs = int(args.group_size)
        if cols % gs:
            msg = f"in_features {cols} is not a multiple of group_size {gs}"
            raise ValueError(msg)
        groups = w.reshape(rows, cols // gs, gs)
        lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    if observer in IMPORTANCE_OBSERVERS:
        if ranges is None:
            raise ValueError("imatrix_mse on NVFP4 weights needs the searched ranges (imatrix_nvfp4_ranges)")
        lo, hi = ranges
        if global_scale is None:
            global_scale = ranges_global_scale([ranges])
        scale, zp = calculate_qparams(lo, hi, args, global_scale=global_scale.to(device=w.device).reshape(1))
        return scale.to(torch.float32), zp, global_scale
    if args.strategy == QuantizationStrategy.TENSOR_GROUP and global_scale is None:
        global_scale = fused_global_scale([weight])
    elif global_scale is not None:
        global_scale = global_scale.to(device=w.device, dtype=torch.float32).reshape(1)
    if observer in NVFP4_OBSERVERS:
        scale, zp = _expanded_search(w, lo, hi, args, global_scale)
    else:  # from the range in the weight's dtype (its values, exactly), as compressed-tensors computes it from a
        # weight's observed range: a bfloat16 weight's max|w_g| / 6 is rounded to bfloat16 (llm-compressor 0.14)
        scale, zp = calculate_qparams(lo.to(weight.dtype), hi.to(weight.dtype), args, global_scale=global_scale)
    return scale.to(torch.float32), zp, global_scale


def _expanded_search(
    w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, args: QuantizationArgs, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``nvfp4_expanded_mse``'s search (module docs): per group of ``w`` ``[rows, cols]`` (extremes ``lo``/``hi``
    ``[rows, cols // 16]``) the NVFP4 scale and zero point of the range ``p * [lo, hi]`` with the smallest
    ``sum |w - q(w)|^2.4``; on equal errors the first (widest) ``p``."""
    rows = w.shape[0]
    search = _NVFP4_SEARCH
    best = torch.full(lo.shape, float("inf"), dtype=torch.float32, device=w.device)
    scale = zp = None
    for i in range(int(search.max_shrink * search.grid)):  # p = 1 ... 1 - (steps - 1) / grid, as llm-compressor
        p = _NVFP4_EXPAND * (1.0 - i / search.grid)
        s, z = calculate_qparams(lo * p, hi * p, args, global_scale=global_scale)
        s = s.to(torch.float32)  # FP8 values, kept in float32 (as observe_scaled_format returns them)
        q = fake_quantize(w, s, z, args, global_scale=global_scale)
        err = (q - w).abs_().pow_(search.norm).reshape(rows, lo.shape[1], -1).sum(dim=2)
        better = err < best
        best = torch.where(better, err, best)
        scale = s if scale is None else torch.where(better, s, scale)
        zp = z if zp is None else torch.where(better, z, zp)
    return scale, zp


def _format_name(args: QuantizationArgs) -> str:
    if args.strategy == QuantizationStrategy.TENSOR_GROUP:
        return "NVFP4 (tensor_group)"
    if args.strategy == QuantizationStrategy.BLOCK:
        return "block-wise"
    return "MX (power-of-two scales)"
