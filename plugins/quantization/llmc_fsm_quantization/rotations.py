"""Rotations fused into the weights before quantization: SpinQuant's R1 and R2 in Hadamard form.

An orthogonal matrix ``Q`` (``Q Q^T = I``) inserted between two linear maps changes
neither their composition nor, on the residual stream of a pre-norm transformer,
the RMSNorms once their scales are folded into the next linears (QuaRot,
Ashkboos et al., arXiv 2404.00456, Sec. 4 "computational invariance"; SpinQuant,
Liu et al., arXiv 2405.16406, Sec. 3, Fig. 1). Rotating spreads outlier channels
over all channels, so the weights (and activations) quantize with less error.

What :class:`SpinQuantModifier` does to a Llama-style model, in float64 (``precision``):

1. untie ``lm_head`` from the input embedding when they share one tensor (R1
   rotates them on different sides); ``config.tie_word_embeddings`` becomes false;
2. fold every RMSNorm's scale ``g`` into the linears that read it
   (``W <- W diag(g)``: q/k/v after ``input_layernorm``, gate/up after
   ``post_attention_layernorm``, ``lm_head`` after the final norm) and set ``g = 1``;
3. R1 (residual stream, size ``hidden_size``): the embedding ``E <- E Q``, every
   linear reading the residual ``W <- W Q`` (q/k/v, gate/up, ``lm_head``), every
   linear writing it ``W <- Q^T W`` and ``b <- Q^T b`` (o_proj, down_proj);
4. R2 (per attention head, size ``head_dim``): rows of each head of v_proj
   ``W_v[h] <- H^T W_v[h]`` (and its bias), columns of each head of o_proj
   ``W_o[:, h] <- W_o[:, h] H``.

Logits are unchanged up to float rounding (checked on a probe input after fusing).
``Q`` is a normalized Hadamard matrix (:func:`hadamard_matrix`), or a block-diagonal
one whose ``transform_block_size`` blocks are all the same matrix (as compressed-tensors
builds it, so ``random-hadamard`` blocks share their random signs).

Online rotations (R3 on queries/keys, R4 on down_proj's input) need a transform
computed at run time; transformers (5.24) does not apply compressed-tensors
transforms when it loads a checkpoint, so they are refused: the saved model would
compute something else than the compressed one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import attrs
import torch
from compressed_tensors import TRANSFORM_CONFIG_NAME
from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme
from torch import nn

import llmc_fsm
from llmc_fsm.toolkit import check_not_quantized

__all__ = [
    "FUSED_ROTATIONS",
    "TRANSFORM_TYPES",
    "RotationPlan",
    "SpinQuantModifier",
    "block_hadamard",
    "blocks_t_times",
    "find_rotation_plan",
    "fold_and_rotate",
    "hadamard_matrix",
    "llmcompressor_transform_config",
    "rotate_heads",
    "times_blocks",
]

logger = logging.getLogger(__name__)

#: Rotations fused into the weights (no run-time cost), as SpinQuant names them.
FUSED_ROTATIONS = ("R1", "R2")
#: Online rotations (SpinQuant's R3, R4): refused, see the module docstring.
ONLINE_ROTATIONS = ("R3", "R4")
#: Values of ``transform_type``.
TRANSFORM_TYPES = ("hadamard", "random-hadamard")
#: Values of ``precision``.
PRECISIONS = {"float64": torch.float64, "float32": torch.float32}

_ONLINE_WHY = (
    "online rotations (R3: queries and keys inside attention; R4: down_proj's input) must run at inference time, "
    "and transformers does not apply compressed-tensors transforms when it loads a checkpoint, so the saved model "
    "would not compute what the compressed one does; use rotations: [R1, R2] (fused into the weights)"
)


# --------------------------------------------------------------------------- Hadamard matrices
def _known_hadamard(size: int) -> bool:
    """Whether a Hadamard matrix of ``size`` can be built: ``K * 2^m`` with ``K`` one of compressed-tensors' known
    orders (1, 2, 4, 12, 20, ..., 256: multiples of 4 up to 256)."""
    if size < 1:
        return False
    while size % 2 == 0 and size > 256:
        size //= 2
    return size in (1, 2) or (size % 4 == 0 and size <= 256)


def hadamard_matrix(
    size: int, *, transform_type: str = "hadamard", dtype: torch.dtype = torch.float64, generator: Any = None
) -> torch.Tensor:
    """A normalized ``[size, size]`` Hadamard matrix ``H / sqrt(size)`` (orthogonal: ``H H^T = I``).

    ``"hadamard"``: deterministic — Sylvester's construction for a power of two,
    else a known Hadamard matrix of order ``K`` (compressed-tensors' table: 12, 20,
    ..., 256) Kronecker a Sylvester matrix (``size = K * 2^m``).
    ``"random-hadamard"``: that matrix times a random ``+-1`` diagonal
    (compressed-tensors' ``random_hadamard_matrix``; QuaRot's randomized Hadamard),
    drawn from ``generator`` (default: a fresh ``torch.Generator``, whose default seed
    makes it the same matrix every run).

    Raises:
        ValueError: unknown ``transform_type``, or no Hadamard matrix of this order is known.
    """
    from compressed_tensors.transform.utils import hadamard as ct_hadamard

    if transform_type not in TRANSFORM_TYPES:
        msg = f"transform_type must be one of {', '.join(TRANSFORM_TYPES)}, got {transform_type!r}"
        raise ValueError(msg)
    if not _known_hadamard(size):
        msg = (
            f"no Hadamard matrix of order {size} is known (orders K * 2^m with K a multiple of 4 up to 256); "
            "set transform_block_size to a power of two that divides it"
        )
        raise ValueError(msg)
    if transform_type == "random-hadamard":
        gen = generator if generator is not None else torch.Generator()
        return ct_hadamard.random_hadamard_matrix(size, torch.float64, gen=gen).div_(math.sqrt(size)).to(dtype)
    if ct_hadamard.is_pow2(size):
        h = ct_hadamard.deterministic_hadamard_matrix(size, torch.float64)
    else:  # K x 2^m: compressed-tensors' Hadamard product applied to the identity
        h = ct_hadamard._matmul_hadU(torch.eye(size, dtype=torch.float64))
    return h.div_(math.sqrt(size)).to(dtype)


def block_hadamard(size: int, block: int, transform_type: str, dtype: torch.dtype) -> torch.Tensor:
    """The diagonal blocks ``[size // block, block, block]`` of a block-diagonal orthogonal ``[size, size]`` matrix:
    one :func:`hadamard_matrix` of order ``block`` (``"random-hadamard"``: its signs drawn once, from a fresh
    ``torch.Generator`` with the default seed) repeated on every block, as compressed-tensors' transform factories
    build a scheme's ``head_dim`` block once and apply it to each (llm-compressor's ``transform_block_size``, and
    what the saved ``transform_config`` describes).

    The result is a broadcast view of that one block (stride 0 along the first dimension), in ``dtype``. Applied by
    :func:`times_blocks` / :func:`blocks_t_times` without forming the whole matrix (``block / size`` of its
    multiply-adds).

    Raises:
        ValueError: as :func:`hadamard_matrix` (no Hadamard matrix of order ``block``).
    """
    one = hadamard_matrix(block, transform_type=transform_type, dtype=dtype)
    return one.expand(size // block, block, block)


def _same_blocks(blocks: torch.Tensor) -> bool:
    return blocks.shape[0] == 1 or blocks.stride(0) == 0  # one block, or one block broadcast (hadamard)


def times_blocks(w: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``w Q`` for ``w`` ``[rows, n * b]`` and ``Q`` the block-diagonal matrix of ``blocks`` ``[n, b, b]``."""
    rows, (n, b, _) = w.shape[0], blocks.shape
    if _same_blocks(blocks):
        return (w.reshape(rows * n, b) @ blocks[0]).reshape(rows, n * b)
    return torch.einsum("rnb,nbc->rnc", w.reshape(rows, n, b), blocks).reshape(rows, n * b)


def blocks_t_times(w: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``Q^T w`` for ``w`` ``[n * b, cols]`` (or ``[n * b]``) and ``Q`` the block-diagonal matrix of ``blocks``."""
    n, b, _ = blocks.shape
    stacked = w.reshape(n, b, -1)
    out = blocks[0].T @ stacked if _same_blocks(blocks) else blocks.transpose(1, 2) @ stacked
    return out.reshape(w.shape)


# --------------------------------------------------------------------------- the model's structure
@attrs.frozen
class _Layer:
    """One Llama-style decoder layer's modules that the rotations touch."""

    name: str
    input_norm: nn.Module
    post_norm: nn.Module
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    gate: nn.Module
    up: nn.Module
    down: nn.Module


@attrs.frozen
class RotationPlan:
    """Where the rotations go in a model (:func:`find_rotation_plan`).

    Attributes:
        embedding: the input embedding (``[vocab, hidden]`` weight).
        final_norm: the RMSNorm before the head.
        head: the output head (``[vocab, hidden]`` Linear).
        tied: whether the head's weight is the embedding's tensor.
        layers: per decoder layer, its norms and linears.
        hidden_size / head_dim / num_heads / num_kv_heads: from the modules' shapes and the config.
    """

    embedding: nn.Module
    final_norm: nn.Module
    head: nn.Module
    tied: bool
    layers: list[_Layer]
    hidden_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int


_LAYER_PARTS = {
    "input_norm": "input_layernorm",
    "post_norm": "post_attention_layernorm",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
#: Parameterised submodules of a layer the rotations leave alone and that keep the model invariant:
#: per-head query/key norms (Qwen3, OLMo 2 style) act on q/k_proj's outputs, which neither R1 nor R2 changes.
_HARMLESS = ("self_attn.q_norm", "self_attn.k_norm")


def _get(root: nn.Module, path: str) -> nn.Module | None:
    module: Any = root
    for part in path.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return None
    return module


def _parameterised(root: nn.Module) -> list[str]:
    return [name for name, m in root.named_modules() if name and any(True for _ in m.parameters(recurse=False))]


def find_rotation_plan(model: nn.Module) -> RotationPlan:
    """Find the embedding, norms, linears and head shapes the rotations need (reads names and shapes only).

    Supports Llama-style decoder-only models (Llama, Mistral, Qwen2/3, SmolLM...):
    ``model.embed_tokens``, ``model.layers[i]`` with ``input_layernorm``,
    ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``,
    ``mlp.{gate,up,down}_proj``, ``model.norm`` and the output embedding.

    Raises:
        ValueError: naming the architecture and what does not fit (a missing module, a
            parameterised module the rotations would not keep invariant, head shapes).
    """
    arch = type(model).__name__
    base = getattr(model, "model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    embedding = getattr(base, "embed_tokens", None)
    final_norm = getattr(base, "norm", None)
    layers = getattr(base, "layers", None)
    missing = [
        what
        for what, found in (
            ("model.embed_tokens", isinstance(embedding, nn.Embedding)),
            ("model.norm", isinstance(final_norm, nn.Module)),
            ("model.layers", isinstance(layers, nn.ModuleList) and len(layers) > 0),
            ("an output head (get_output_embeddings) with a Linear weight", isinstance(head, nn.Linear)),
        )
        if not found
    ]
    if missing:
        msg = (
            f"SpinQuantModifier cannot rotate {arch}: it needs a Llama-style decoder-only model and finds no "
            f"{', '.join(missing)}"
        )
        raise ValueError(msg)
    plan_layers: list[_Layer] = []
    for i, layer in enumerate(layers):
        parts = {key: _get(layer, path) for key, path in _LAYER_PARTS.items()}
        absent = [_LAYER_PARTS[key] for key, m in parts.items() if m is None]
        experts = [n for n, _ in layer.named_modules() if n.rsplit(".", 1)[-1] == "experts"]
        if absent and experts:
            msg = (
                f"SpinQuantModifier cannot rotate {arch}: model.layers.{i} is a mixture-of-experts layer "
                f"(model.layers.{i}.{experts[0]}), which the rotations do not support (only dense Llama-style MLPs: "
                "mlp.gate_proj, mlp.up_proj, mlp.down_proj); quantize this model without SpinQuantModifier"
            )
            raise ValueError(msg)
        if absent:
            msg = f"SpinQuantModifier cannot rotate {arch}: model.layers.{i} has no {', '.join(absent)}"
            raise ValueError(msg)
        known = set(_LAYER_PARTS.values()) | set(_HARMLESS)
        extra = [n for n in _parameterised(layer) if n not in known]
        if extra:
            msg = (
                f"SpinQuantModifier cannot rotate {arch}: model.layers.{i} has parameterised modules the rotations "
                f"would not keep invariant ({', '.join(extra)}); only Llama-style layers are supported"
            )
            raise ValueError(msg)
        plan_layers.append(_Layer(name=f"model.layers.{i}", **parts))  # type: ignore[arg-type]
    allowed = {id(embedding), id(final_norm), id(head)} | {id(m) for m in layers.modules()}
    outside = [
        n for n, m in model.named_modules() if id(m) not in allowed and any(True for _ in m.parameters(recurse=False))
    ]
    if outside:
        msg = (
            f"SpinQuantModifier cannot rotate {arch}: it has parameterised modules outside the decoder layers, "
            f"embedding, final norm and head ({', '.join(outside[:5])}); only Llama-style models are supported"
        )
        raise ValueError(msg)
    hidden = int(embedding.weight.shape[1])
    config = getattr(model, "config", None)
    first = plan_layers[0]
    head_dim = getattr(getattr(layers[0], "self_attn", None), "head_dim", None) or getattr(config, "head_dim", None)
    num_heads = getattr(config, "num_attention_heads", None)
    num_kv = getattr(config, "num_key_value_heads", None) or num_heads
    if not head_dim or not num_heads:
        msg = f"SpinQuantModifier cannot rotate {arch}: cannot read head_dim / num_attention_heads"
        raise ValueError(msg)
    head_dim, num_heads, num_kv = int(head_dim), int(num_heads), int(num_kv)
    if first.v.weight.shape[0] != num_kv * head_dim or first.o.weight.shape[1] != num_heads * head_dim:
        msg = (
            f"SpinQuantModifier cannot rotate {arch}: v_proj has {first.v.weight.shape[0]} outputs and o_proj "
            f"{first.o.weight.shape[1]} inputs, not {num_kv} and {num_heads} heads of {head_dim}"
        )
        raise ValueError(msg)
    return RotationPlan(
        embedding=embedding,
        final_norm=final_norm,
        head=head,
        tied=head.weight is embedding.weight,
        layers=plan_layers,
        hidden_size=hidden,
        head_dim=head_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv,
    )


def _check_rmsnorm(norm: nn.Module, name: str) -> None:
    """Raise unless ``norm(x) == x / sqrt(mean(x^2) + eps) * weight`` on a float64 probe (no mean subtraction,
    no ``1 + weight``, no bias): only then can its scale be folded into the next linears and R1 pass through it."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or getattr(norm, "bias", None) is not None:
        msg = f"SpinQuantModifier: {name} ({type(norm).__name__}) is not an RMSNorm with a scale vector"
        raise ValueError(msg)
    probe = torch.linspace(-2.0, 3.0, 2 * weight.numel(), dtype=weight.dtype, device=weight.device).reshape(2, -1)
    with torch.no_grad():
        out = norm(probe).to(torch.float64)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)) or 0.0
        x = probe.to(torch.float64)
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(eps)) * weight.to(torch.float64)
    tolerance = 1e-4 if torch.finfo(weight.dtype).bits >= 32 else 2e-2
    if not torch.allclose(out, ref, rtol=tolerance, atol=tolerance):
        msg = (
            f"SpinQuantModifier: {name} ({type(norm).__name__}) does not compute x / rms(x) * weight, so its scale "
            "cannot be folded into the next linears; only RMSNorm models (Llama-style) are supported"
        )
        raise ValueError(msg)


# --------------------------------------------------------------------------- the transformations (in place)
@torch.no_grad()
def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value.to(param.dtype))


#: Rows of a weight updated at a time by :func:`_update_rows`: its working-precision copies stay 4096 x hidden
#: (SmolLM2's 49152 x 576 embedding and head in float64 whole: 226 MB each, twice, at once).
ROW_BLOCK = 4096


def _update_rows(weight: torch.Tensor, fn: Any, precision: torch.dtype) -> None:
    """``weight <- fn(weight)`` for a row-wise ``fn`` (each output row depends on its input row only), computed in
    ``precision`` :data:`ROW_BLOCK` rows at a time, so no working copy of the whole weight is made."""
    for block in weight.split(ROW_BLOCK):
        _set(block, fn(block.to(precision)))


@torch.no_grad()
def untie(model: nn.Module, plan: RotationPlan) -> RotationPlan:
    """Give the head its own copy of the embedding's weight and record it in the config; return the new plan."""
    if not plan.tied:
        return plan
    plan.head.weight = nn.Parameter(plan.embedding.weight.detach().clone(), requires_grad=False)
    config = getattr(model, "config", None)
    for cfg in {id(c): c for c in (config, getattr(config, "get_text_config", lambda: None)())}.values():
        if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False
    return attrs.evolve(plan, tied=False)


@torch.no_grad()
def fold_and_rotate(plan: RotationPlan, precision: torch.dtype, r1: torch.Tensor | None) -> None:
    """Fold each RMSNorm's scale into the linears that read it and, given ``r1``, rotate the residual stream.

    Norms (QuaRot Sec. 4: a rotation commutes with ``x / rms(x)`` but not with the scale ``g``): q/k/v after
    ``input_layernorm``, gate/up after ``post_attention_layernorm``, ``lm_head`` after the final norm take
    ``W <- W diag(g)``, and ``g`` becomes 1. R1 (``r1``: the diagonal blocks ``[n, b, b]`` of the orthogonal
    ``Q``, :func:`block_hadamard`): those readers take ``W <- W diag(g) Q`` in the same pass (computed in
    ``precision``, stored once in the weight's dtype), the embedding ``E <- E Q``, the writers (o, down)
    ``W <- Q^T W`` and ``b <- Q^T b``. The head must be untied first (:func:`untie`).
    """
    rotate = (lambda w: times_blocks(w, r1)) if r1 is not None else (lambda w: w)
    pairs: list[tuple[nn.Module, list[nn.Module]]] = [
        (pair[0], pair[1])
        for layer in plan.layers
        for pair in ((layer.input_norm, [layer.q, layer.k, layer.v]), (layer.post_norm, [layer.gate, layer.up]))
    ]
    pairs.append((plan.final_norm, [plan.head]))
    for norm, linears in pairs:
        g = norm.weight.to(precision)
        for linear in linears:
            _update_rows(linear.weight, lambda w, g=g: rotate(w * g), precision)
        norm.weight.fill_(1.0)
    if r1 is None:
        return
    _update_rows(plan.embedding.weight, rotate, precision)
    for m in (x for layer in plan.layers for x in (layer.o, layer.down)):
        _set(m.weight, blocks_t_times(m.weight.to(precision), r1))
        if getattr(m, "bias", None) is not None:
            _set(m.bias, blocks_t_times(m.bias.to(precision), r1))


@torch.no_grad()
def rotate_heads(plan: RotationPlan, h: torch.Tensor) -> None:
    """R2: rotate each attention head's values by ``h`` ``[head_dim, head_dim]`` (orthogonal).

    v_proj's rows of each key/value head ``W_v[h] <- H^T W_v[h]`` (and bias); o_proj's columns of each head
    ``W_o[:, h] <- W_o[:, h] H``. Every query head reads a rotated value head, so attention's output per
    head is rotated by ``H`` and o_proj undoes it.
    """
    p, d = h.dtype, h.shape[0]
    for layer in plan.layers:
        wv = layer.v.weight.to(p)
        _set(layer.v.weight, (h.T @ wv.reshape(-1, d, wv.shape[1])).reshape(wv.shape))
        if getattr(layer.v, "bias", None) is not None:
            bv = layer.v.bias.to(p)
            _set(layer.v.bias, (bv.reshape(-1, d) @ h).reshape(bv.shape))
        wo = layer.o.weight.to(p)
        _set(layer.o.weight, (wo.reshape(wo.shape[0], -1, d) @ h).reshape(wo.shape))


# --------------------------------------------------------------------------- the modifier
def _rotations(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, Iterable) else None
    if not items or not all(isinstance(v, str) for v in items):
        msg = f"rotations must be a non-empty list of R1, R2 (R3, R4 are refused), got {value!r}"
        raise ValueError(msg)
    names = tuple(dict.fromkeys(getattr(v, "value", v).upper() for v in items))
    unknown = [n for n in names if n not in FUSED_ROTATIONS + ONLINE_ROTATIONS]
    if unknown:
        msg = f"rotations: unknown {', '.join(unknown)}; SpinQuant's rotations are R1, R2, R3, R4"
        raise ValueError(msg)
    online = [n for n in names if n in ONLINE_ROTATIONS]
    if online:
        msg = f"rotations {', '.join(online)} are not supported: {_ONLINE_WHY}"
        raise ValueError(msg)
    return names


def _transform_type(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value == "random-matrix":
        msg = (
            "transform_type random-matrix is not supported: a random matrix is not orthogonal, so R1 would not pass "
            "through the RMSNorms and the float model would change; use hadamard or random-hadamard"
        )
        raise ValueError(msg)
    if value not in TRANSFORM_TYPES:
        msg = f"transform_type must be one of {', '.join(TRANSFORM_TYPES)}, got {value!r}"
        raise ValueError(msg)


def _only_false(why: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not False:
            msg = f"{attribute.name}: {value!r} is not supported ({why}); use {attribute.name}: false"
            raise ValueError(msg)

    return check


def _only_none(why: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None:
            msg = f"{attribute.name} is not supported ({why}); remove it"
            raise ValueError(msg)

    return check


def _precision(value: Any) -> str:
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, str):  # llm-compressor's saved recipe.yaml writes torch.float64
        value = value.removeprefix("torch.")
    if value not in PRECISIONS:
        msg = f"precision must be float64 or float32, got {value!r}"
        raise ValueError(msg)
    return value


#: Where llm-compressor 0.14's resolved ``transform_config`` applies each rotation of a Llama-style model (what its
#: saved recipe.yaml and config.json record for ``rotations`` / ``transform_type`` / ``transform_block_size``): per
#: rotation, the ``(location, inverse, targets)`` of its ``apply`` entries, in its order.
_LLMCOMPRESSOR_APPLY_ORDER = {
    "R1": (
        ("weight_output", False, ("re:.*embed_tokens$", "re:.*o_proj$", "re:.*down_proj$")),
        (
            "weight_input",
            True,
            ("re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$", "re:.*up_proj$", "re:.*gate_proj$", "lm_head"),
        ),
    ),
    "R2": (("weight_output", False, ("re:.*v_proj$",)), ("weight_input", True, ("re:.*o_proj$",))),
}
#: :data:`_LLMCOMPRESSOR_APPLY_ORDER` as sets (a recipe's ``transform_config`` may list them in any order).
_LLMCOMPRESSOR_APPLY = {
    name: {(location, inverse, frozenset(targets)) for location, inverse, targets in entries}
    for name, entries in _LLMCOMPRESSOR_APPLY_ORDER.items()
}


def llmcompressor_transform_config(
    rotations: Iterable[str], transform_type: str, block_size: int | None, precision: str, head_dim: int
) -> TransformConfig:
    """The ``transform_config`` llm-compressor 0.14's ``SpinQuantModifier`` attaches to the model and writes into
    ``config.json``'s ``quantization_config``: one compressed-tensors ``TransformScheme`` per rotation (``R1`` then
    ``R2``), every location a ``weight_*`` one (fused into the weights, which neither transformers nor vLLM applies
    again on load: vLLM applies only the online ``input`` / ``output`` locations).

    Args:
        rotations: some of ``R1``, ``R2``.
        transform_type: ``hadamard`` or ``random-hadamard``.
        block_size: R1's ``head_dim`` (``transform_block_size``; ``None``: one block of ``hidden_size``).
        precision: ``float64`` or ``float32``.
        head_dim: R2's ``head_dim``, the model's attention head size.

    Returns:
        A ``compressed_tensors.transform.TransformConfig``.
    """
    chosen = set(rotations)
    groups = {
        name: TransformScheme(
            type=transform_type,
            apply=[
                TransformArgs(targets=list(targets), location=location, inverse=inverse)
                for location, inverse, targets in entries
            ],
            randomize=False,
            requires_grad=False,
            head_dim=block_size if name == "R1" else head_dim,
            precision=PRECISIONS[precision],
        )
        for name, entries in _LLMCOMPRESSOR_APPLY_ORDER.items()
        if name in chosen
    }
    return TransformConfig(config_groups=groups)


def _transform_config_problem(instance: Any, value: Any) -> str | None:
    """Why ``value`` is not the ``transform_config`` llm-compressor 0.14 resolves from the modifier's ``rotations``,
    ``transform_type``, ``transform_block_size`` and ``precision`` (its saved recipe.yaml writes that one), or
    ``None``."""
    groups = value.get("config_groups") if isinstance(value, dict) and set(value) == {"config_groups"} else None
    if not isinstance(groups, dict) or set(groups) != set(instance.rotations):
        return f"its config_groups are not one per rotation of {list(instance.rotations)}"
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("apply"), list):
            return f"group {name} has no apply list"
        applied = {
            (a.get("location"), a.get("inverse"), frozenset(a.get("targets") or ()))
            for a in group["apply"]
            if isinstance(a, dict) and not a.get("ignore")
        }
        head_dim = instance.transform_block_size if name == "R1" else group.get("head_dim")
        if (
            group.get("type") != instance.transform_type
            or group.get("randomize", False) is not False
            or group.get("requires_grad", False) is not False
            or str(group.get("precision", instance.precision)).removeprefix("torch.") != instance.precision
            or group.get("head_dim") != head_dim
            or len(applied) != len(group["apply"])
            or applied != _LLMCOMPRESSOR_APPLY[name]
        ):
            return f"group {name} is not what llm-compressor resolves from the other arguments"
    return None


def _transform_config(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """``transform_config``: ``null``, or exactly the one llm-compressor 0.14 resolves from the other arguments and
    writes into its saved recipe.yaml (accepted: it says nothing they do not; R2's ``head_dim`` is checked against
    the model's in ``check_model``)."""
    if value is None:
        return
    problem = _transform_config_problem(instance, value)
    if problem is not None:
        msg = (
            f"transform_config is not supported ({problem}); give rotations, transform_type and "
            "transform_block_size instead"
        )
        raise ValueError(msg)


def _block_size(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        msg = f"transform_block_size must be a positive int or null, got {value!r}"
        raise ValueError(msg)


def _check_not_pruned(plan: RotationPlan) -> None:
    """Refuse a model whose decoder-layer Linears hold pruned zeros (at least 5% exact zeros; a weight on ``meta`` is
    not read): the rotation fills them (pruned in an earlier run, an applied stage of the model's recipe.yaml, or
    elsewhere: a tester's cases; an earlier stage of the same recipe is refused by one-shot from the recipe)."""
    for layer in plan.layers:
        for part in ("q", "k", "v", "o", "gate", "up", "down"):
            weight = getattr(layer, part).weight
            if weight.is_meta or not weight.numel():
                continue
            zeros = float((weight == 0).sum()) / weight.numel()
            if zeros >= 0.05:
                msg = (
                    f"SpinQuantModifier: {layer.name}.{_LAYER_PARTS[part]} holds {zeros:.0%} zeros (pruned); the "
                    "rotation mixes its channels and fills them: rotate the dense model first (a SpinQuant stage), "
                    "then prune"
                )
                raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class SpinQuantModifier(llmc_fsm.Modifier):
    """Fuse SpinQuant's R1 (residual) and R2 (per-head) Hadamard rotations into the weights (float model unchanged).

    Runs at ``initialize``, before any calibration, so a quantizer in the same or a
    later stage (GPTQ, round-to-nearest) quantizes the rotated weights. See the
    module docstring for the steps (norm folding, untying, R1, R2).

    Args (llm-compressor's names):
        rotations: ``[R1, R2]`` (default), or one of them. ``R3``/``R4`` are refused
            (online rotations; see the module docstring).
        transform_type: ``hadamard`` (default; deterministic) or ``random-hadamard``
            (random signs from a ``torch.Generator`` with its default seed: the same
            every run). ``random-matrix`` is refused (not orthogonal).
        transform_block_size: R1 uses a block-diagonal matrix of Hadamard blocks of
            this size (must divide ``hidden_size``), one matrix repeated on every block
            (:func:`block_hadamard`); default ``null``: one block of ``hidden_size``.
            R2 always uses ``head_dim`` (as llm-compressor).
        precision: ``float64`` (default) or ``float32``: the dtype the weights are
            transformed in (they are stored back in their own dtype).
        randomize, learnable: only ``false`` (a distinct matrix per module, and
            SpinQuant's learned Cayley-optimized rotations, are not implemented).
        mappings, norm_mappings: only ``null``: the modules come from the model's structure
            (:func:`find_rotation_plan`).
        transform_config: ``null``, or the one llm-compressor resolves from the arguments above and writes into its
            saved recipe.yaml (checked to say exactly that; any other is refused).

    Requires state ``model``. Refuses (``ValueError``, before changing anything) a
    quantized model, a model that is not Llama-style, a norm that is not an RMSNorm,
    and sizes with no Hadamard matrix. One-shot refuses it after a pruning modifier of the
    same recipe (:attr:`keeps_zeros`).
    """

    required_state = frozenset({"model"})
    #: A rotation mixes every input (R1) or head (R2) channel: the zeros of a pruned weight are filled, so one-shot
    #: refuses it after a pruning modifier of the same recipe (B2's case: 2:4 pruning, then SpinQuant, saved a dense
    #: model whose recipe.yaml marked the pruning applied).
    keeps_zeros = False

    rotations: tuple[str, ...] = attrs.field(default=("R1", "R2"), converter=_rotations)
    transform_type: str = attrs.field(default="hadamard", validator=_transform_type)
    transform_block_size: int | None = attrs.field(default=None, validator=_block_size)
    precision: str = attrs.field(default="float64", converter=_precision)
    randomize: bool = attrs.field(default=False, validator=_only_false("a distinct matrix per module"))
    learnable: bool = attrs.field(
        default=False, validator=_only_false("learned rotations: the rotations here are fixed Hadamard matrices")
    )
    mappings: Any = attrs.field(
        default=None, validator=_only_none("the modules are found from the model's Llama-style structure")
    )
    norm_mappings: Any = attrs.field(
        default=None, validator=_only_none("the norms are found from the model's Llama-style structure")
    )
    transform_config: Any = attrs.field(default=None, validator=_transform_config)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        #: What the rotation did (filled at initialize): rotations, sizes, untied, max |logit change| on a probe.
        self.summary: dict[str, Any] = {}

    def check_model(self, model: nn.Module) -> RotationPlan:
        """Find where the rotations go and check every size; reads names and shapes only (works on ``meta``).

        Raises:
            ValueError: an already quantized model, a model that is not Llama-style, or a size with no
                Hadamard matrix (``transform_block_size`` not dividing ``hidden_size``...).
        """
        check_not_quantized(model, "SpinQuantModifier", "rotate the full-precision model")
        quantized = [n for n, m in model.named_modules() if hasattr(m, "quantization_scheme")]
        if quantized:
            msg = (
                f"SpinQuantModifier: {len(quantized)} modules are already quantized (e.g. {quantized[0]}); rotations "
                "go before quantization: put SpinQuantModifier in the first stage"
            )
            raise ValueError(msg)
        plan = find_rotation_plan(model)
        if "R1" in self.rotations:
            block = self.transform_block_size or plan.hidden_size
            if plan.hidden_size % block:
                msg = f"transform_block_size {block} does not divide hidden_size {plan.hidden_size}"
                raise ValueError(msg)
            if not _known_hadamard(block):
                msg = (
                    f"SpinQuantModifier: no Hadamard matrix of order {block} (R1) is known; set "
                    "transform_block_size to a power of two that divides hidden_size "
                    f"{plan.hidden_size} (e.g. {plan.hidden_size & -plan.hidden_size})"
                )
                raise ValueError(msg)
        if "R2" in self.rotations and not _known_hadamard(plan.head_dim):
            block = self.transform_block_size or plan.hidden_size
            r1_valid = plan.hidden_size % block == 0 and _known_hadamard(block)
            r1_only = (
                "rotations: [R1]"
                if r1_valid
                else f"rotations: [R1] with transform_block_size: {plan.hidden_size & -plan.hidden_size}"
            )
            msg = (
                f"SpinQuantModifier: no Hadamard matrix of order head_dim {plan.head_dim} (R2) is known (orders "
                f"K * 2^m with K a multiple of 4 up to 256); use {r1_only} to rotate the residual stream only"
            )
            raise ValueError(msg)
        given = (self.transform_config or {}).get("config_groups", {}).get("R2", {}).get("head_dim", plan.head_dim)
        if "R2" in self.rotations and given != plan.head_dim:
            msg = (
                f"SpinQuantModifier: transform_config's R2 head_dim {given} is not the model's head_dim "
                f"{plan.head_dim} (llm-compressor's saved transform_config is the model's it was made for)"
            )
            raise ValueError(msg)
        _check_not_pruned(plan)
        return plan

    def modules_changed(self, model: nn.Module) -> dict[str, nn.Module]:
        """The modules whose weights the rotations (and the norm folding) change, by name: the embedding, the head,
        every decoder layer's norms and Linears, the final norm (one-shot reads them for NaN/Inf before any stage
        runs; a tester found a NaN rotated into 64 NaN of down_proj)."""
        plan = find_rotation_plan(model)
        names = {id(m): n for n, m in model.named_modules()}
        parts = [plan.embedding, plan.final_norm, plan.head]
        parts += [getattr(layer, part) for layer in plan.layers for part in _LAYER_PARTS]
        return {names[id(m)]: m for m in parts if id(m) in names}

    def on_initialize(self, state: Any) -> None:
        model = state.model
        plan = self.check_model(model)
        for layer in plan.layers:
            _check_rmsnorm(layer.input_norm, f"{layer.name}.input_layernorm")
            _check_rmsnorm(layer.post_norm, f"{layer.name}.post_attention_layernorm")
        _check_rmsnorm(plan.final_norm, "model.norm")
        probe = _probe_input(model, plan)
        before = _logits(model, probe)
        self.apply(model, plan)
        after = _logits(model, probe)
        change = float((after - before).abs().max())
        scale = float(before.abs().max()) or 1.0
        self.summary["max_logit_change"] = change
        logger.info("SpinQuantModifier: %s fused; max |logit change| on a probe %.3g", "+".join(self.rotations), change)
        tolerance = 1e-3 if torch.finfo(plan.embedding.weight.dtype).bits >= 32 else 1e-1
        if change > tolerance * scale:
            msg = (
                f"SpinQuantModifier: after fusing the rotations the logits changed by up to {change:.3g} (of "
                f"{scale:.3g}): {type(model).__name__} is not rotation-invariant as built; the model was modified "
                "in place: reload it"
            )
            raise RuntimeError(msg)

    def apply(self, model: nn.Module, plan: RotationPlan | None = None) -> None:
        """Untie, fold the norms and fuse the rotations into ``model``'s weights (in place), and attach
        :func:`llmcompressor_transform_config` as ``model.transform_config`` (written into ``quantization_config``
        when the model is saved quantized).

        Raises:
            ValueError: as :meth:`check_model` (before any change).
        """
        plan = plan if plan is not None else self.check_model(model)
        precision = PRECISIONS[self.precision]
        self.summary.update(rotations=list(self.rotations), tied=plan.tied, transform_type=self.transform_type)
        plan = untie(model, plan)
        r1 = None
        if "R1" in self.rotations:
            block = self.transform_block_size or plan.hidden_size
            r1 = block_hadamard(plan.hidden_size, block, self.transform_type, precision)
            self.summary["r1_block_size"] = block
        fold_and_rotate(plan, precision, r1)
        if "R2" in self.rotations:
            rotate_heads(plan, hadamard_matrix(plan.head_dim, transform_type=self.transform_type, dtype=precision))
            self.summary["r2_size"] = plan.head_dim
        config = llmcompressor_transform_config(
            self.rotations, self.transform_type, self.transform_block_size, self.precision, plan.head_dim
        )
        setattr(model, TRANSFORM_CONFIG_NAME, config)  # compressed-tensors' ModelCompressor writes it on save


def _probe_input(model: nn.Module, plan: RotationPlan) -> torch.Tensor:
    vocab = int(plan.embedding.weight.shape[0])
    device = plan.embedding.weight.device
    return (torch.arange(16, device=device) * 7919 % vocab).reshape(1, 16)


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.detach().to(torch.float64)
