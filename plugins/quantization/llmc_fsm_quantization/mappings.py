"""Smoothing mappings: which layer's output channels are scaled down and which Linears' inputs scaled up.

A *mapping* pairs a **smooth layer** (a norm, or a Linear) with the **balance layers** that read its
output: SmoothQuant (Xiao et al., arXiv 2211.10438, Sec. 4) and AWQ (Lin et al., arXiv 2306.00978,
Sec. 3.2) divide the smooth layer's output channel ``j`` by ``s_j`` and multiply input column ``j`` of
every balance layer by ``s_j``, so the float model computes the same function (:func:`fold_scales`).

Default mappings are derived per decoder layer from the module graph (names and types, no forward;
works on a ``meta`` model), for Llama-style pre-norm layers (Llama, Mistral, Qwen2/3, SmolLM2, ...):

=====================================  =======================================  =====================
smooth layer                           balance layers                           when
=====================================  =======================================  =====================
``input_layernorm``                    ``q_proj``, ``k_proj``, ``v_proj``        always
``v_proj``                             ``o_proj``                               ``v.out == o.in``
``post_attention_layernorm``           ``gate_proj``, ``up_proj``               a pre-MLP norm
``up_proj``                            ``down_proj``                            ``up.out == down.in``
``post_attention_layernorm``           the router, the shared expert's          a mixture-of-experts
                                       ``gate_proj``, ``up_proj`` and gate,     block (below)
                                       every expert's ``gate_proj``,
                                       ``up_proj``
``shared_expert(s).up_proj``           its ``down_proj``                        a shared expert
``experts.<e>.up_proj``                ``experts.<e>.down_proj``                per expert, as above
=====================================  =======================================  =====================

Gateless MLPs and experts (Nemotron-H: ``down(relu2(up x))`` in its MLP, shared expert and routed experts): the norm
mapping holds the router, the shared expert's ``up_proj`` and every expert's ``up_proj``; ``up_proj -> down_proj`` is
a mapping only where the activation is positively homogeneous (:func:`homogeneity_degree`: transformers'
``ReLUSquaredActivation``, degree 2), folded with ``up``'s rows divided by ``s ** (1 / 2)``
(:attr:`ResolvedMapping.degree`, :func:`fold_scales`); through another activation it has no exact fold and is left
out (a warning names it; fused experts are then refused by AWQ).

Mixture-of-experts layers whose experts transformers 5 keeps fused (``MixtralExperts``, ``Qwen3MoeExperts``: 3-D
``gate_up_proj`` / ``down_proj``, seen per expert through :mod:`llmc_fsm.toolkit.views`): every expert's gate and up
rows and the router read the block's input, the normed hidden states, so one per-channel scale is shared by all of
them; the router's weight is compensated too (it is not quantized, but without it the float routing would change).
Each expert's ``up`` rows -> its ``down_proj`` columns is a mapping of its own (its scale from the tokens routed to
it). As AutoAWQ's Mixtral mappings (``block_sparse_moe.gate`` among the balance layers) and llm-compressor's MoE
mappings. A shared expert (DeepSeek-V3's ``shared_experts``, Qwen3-Next's ``shared_expert``) and its 1-output gate
(Qwen3-Next's ``shared_expert_gate``) read the block's input too: they are balance layers of the same norm mapping
(:func:`shared_expert_readers`), whose parent is the whole block (routed plus shared output), and the shared expert's
``up_proj -> down_proj`` is a mapping like a dense MLP's. Granite-MoE-Hybrid's ``shared_mlp`` sits beside the block
in the decoder layer and reads the same norm output: its fused ``[gate; up]`` ``input_linear`` is a balance layer of
the norm mapping too (whose parent is then the decoder layer), and ``input_linear``'s ``up`` rows -> ``output_linear``
a mapping of AWQ's (:func:`fused_tail`). The block must hold nothing else, the experts a gate without
biases and transformers' own ``act(gate) * up`` (not GPT-OSS's clamped gate), in transformers' layout class or Llama
4's (not DBRX's): :func:`moe_mapping_problem` says why a block does not fit.

``v_proj -> o_proj`` needs one value channel per ``o_proj`` input (no grouped-query attention: with
GQA a value channel feeds several heads' outputs); ``post_attention_layernorm`` is skipped when the
layer also has ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` (then it normalizes the
attention *output*, Gemma 2/3, OLMo 2). Norms whose output is ``(1 + weight) * f(x)`` (Gemma, Qwen3-Next:
:func:`scales_by_one_plus_weight`) take the scale as ``weight = (1 + weight) / s - 1`` (:func:`fold_scales`).

A recipe may give the mappings itself, as llm-compressor writes them (:func:`parse_mappings`):
``[[[balance patterns...], smooth pattern], ...]`` (SmoothQuant) or
``[{smooth_layer: PATTERN, balance_layers: [PATTERNS...]}, ...]`` (AWQ). Patterns are full module
names, class names or ``re:<regex>`` (``re.match`` on the full name, :func:`llmc_fsm.toolkit.targets.matches`).
For each module the smooth pattern matches, every balance pattern is looked up in the innermost
enclosing module where each of them matches (its decoder layer, or its attention block for
``v_proj -> o_proj``); every match there is a balance layer, as llm-compressor 0.14 takes them
(``re:.*self_attn\\.(q|k|v)_proj$`` is ``q_proj``, ``k_proj``, ``v_proj``), but a pattern matching several Linears
of several decoder layers is not (a final norm whose nearest ``q_proj`` s are every layer's: that smooth layer is
skipped, with a warning). A recipe mapping that fits none of the smooth layers it matches is refused. The
per-expert matrices of fused experts are matched by their view names (``<experts>.<e>.gate_proj``, ``.up_proj``,
``.down_proj``, :func:`~llmc_fsm.toolkit.weight_views`) and a balance pattern may match every expert of one
experts module, as llm-compressor's MoE mappings write them::

    - smooth_layer: "re:.*post_attention_layernorm$"
      balance_layers: ["re:.*mlp.gate$", "re:.*mlp.experts.*.gate_proj$", "re:.*mlp.experts.*.up_proj$"]
    - smooth_layer: "re:.*up_proj$"            # each expert's up_proj (and a dense MLP's)
      balance_layers: ["re:.*down_proj$"]      # its own down_proj, the innermost match

These resolve to the default mixture-of-experts mappings above (the same modules, the balance layers in the model's
order), so they give the same result. Refused, naming the modules: a norm mapping onto experts that leaves out the
router, a shared expert's gate/up or some expert's gate/up rows (they read the norm's output too, so the float model
would change), an expert's ``up_proj`` onto anything but its own ``down_proj``, and experts
:func:`moe_mapping_problem` rejects.
"""

from __future__ import annotations

import inspect
import logging
import re
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from llmc_fsm import find_decoder_layers
from llmc_fsm.toolkit import (
    LinearView,
    compact_names,
    experts_layout,
    is_linear_like,
    matches,
    router_names,
    weight_views,
)

__all__ = [
    "AWQMapping",
    "MappingSpec",
    "ResolvedMapping",
    "architecture",
    "default_mappings",
    "describe_mappings",
    "fold_scales",
    "fused_tail",
    "homogeneity_degree",
    "mappings_to_recipe",
    "mappings_to_smoothquant_recipe",
    "moe_mapping_problem",
    "moe_router",
    "parse_mappings",
    "resolve_mappings",
    "scales_by_one_plus_weight",
    "shared_expert_readers",
    "smooth_channels",
    "unsmoothed_mixers",
]

logger = logging.getLogger(__name__)

#: why a mapping's ``activation_hook_target`` is refused
_HOOK_TARGET_UNSUPPORTED = "activation_hook_target, for parallel attention/MLP blocks, is not supported: leave it out"

#: models whose mixers no default mapping reaches were named for (:func:`default_mappings`)
_WARNED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _balance_patterns(value: Any) -> tuple[str, ...]:
    patterns = _patterns(value)
    if patterns is None:
        msg = f"balance_layers: {value!r}: give a non-empty list of module names, class names or re:<regex> patterns"
        raise ValueError(msg)
    return patterns


def _no_hook_target(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        msg = (
            f"{_HOOK_TARGET_UNSUPPORTED} (got activation_hook_target={value!r} for smooth layer "
            f"{instance.smooth_layer!r})"
        )
        raise ValueError(msg)


@attrs.frozen
class MappingSpec:
    """One recipe mapping: a smooth-layer pattern and the balance-layer patterns (see the module docstring).

    Built as llm-compressor's ``AWQMapping`` is (also exported under that name): ``MappingSpec(smooth_layer,
    balance_layers)``, ``balance_layers`` a list or tuple of patterns (one string is one pattern).

    Raises:
        ValueError: ``smooth_layer`` is not a non-empty string, ``balance_layers`` has no pattern or a
            non-string one, or ``activation_hook_target`` is given (parallel attention/MLP blocks are not
            supported).
    """

    smooth_layer: str = attrs.field()
    balance_layers: tuple[str, ...] = attrs.field(converter=_balance_patterns)
    activation_hook_target: None = attrs.field(default=None, validator=_no_hook_target, repr=False)

    @smooth_layer.validator
    def _check_smooth(self, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, str) or not value:
            msg = f"smooth_layer: {value!r}: give a module name, class name or re:<regex> pattern"
            raise ValueError(msg)

    def to_recipe(self) -> dict[str, Any]:
        """The llm-compressor AWQ form ``{smooth_layer: ..., balance_layers: [...]}`` (what an AWQModifier's
        recipe.yaml holds)."""
        return {"smooth_layer": self.smooth_layer, "balance_layers": list(self.balance_layers)}

    def to_smoothquant_recipe(self) -> list[Any]:
        """The llm-compressor SmoothQuant form ``[[balance patterns...], smooth pattern]`` (what a
        SmoothQuantModifier's recipe.yaml holds; llm-compressor 0.14's SmoothQuantModifier reads only this form)."""
        return [list(self.balance_layers), self.smooth_layer]


@attrs.frozen(eq=False)
class ResolvedMapping:
    """A mapping resolved in one model.

    Attributes:
        smooth_name / smooth: the smooth layer (a norm with a 1-D ``weight`` of ``C`` channels, or a
            Linear of ``C`` output features).
        balance_names / balances: the Linears that read its output (``in_features == C``).
        parent_name / parent: the innermost module holding every balance layer (a single balance
            layer: itself) -- AWQ measures this block's output error.
        experts: for a mixture-of-experts mapping, the fused experts module whose expert matrices
            (:class:`~llmc_fsm.toolkit.views.LinearView`) are among the smooth and balance layers; ``None`` otherwise.
        degree: ``k`` of the function between the smooth layer's output and the balance layers' input, positively
            homogeneous of degree ``k`` (``f(y / t) = f(y) / t ** k``, ``t > 0``): ``1`` for a norm's output read
            directly, ``v -> o`` and a gated ``up -> down`` (``act(gate) * up`` is linear in ``up``); ``2`` for a
            gateless ``up -> down`` through squared ReLU (Nemotron-H's experts, shared expert and MLP:
            :func:`homogeneity_degree`); ``None``: none is known (an ``up -> down`` through another activation
            without a gate), the mapping cannot be folded exactly (:func:`fold_scales` refuses it).
    """

    smooth_name: str
    smooth: nn.Module
    balance_names: tuple[str, ...]
    balances: tuple[nn.Module, ...]
    parent_name: str
    parent: nn.Module
    experts: nn.Module | None = None
    degree: int | None = 1

    @property
    def reader(self) -> nn.Module:
        """The module whose first input is the smooth layer's output (its statistics are taken there): the
        mixture-of-experts block for a norm mapping onto the router and experts (the parent, holding the experts),
        else the first balance layer (also when a parallel layer's norm feeds attention and experts alike: its
        ``q_proj``, Cohere2-MoE)."""
        if self.experts is not None and self.smooth.weight.dim() == 1:
            if any(child is self.experts for child in self.parent.children()):
                return self.parent
        return self.balances[0]

    @property
    def channels(self) -> int:
        """``C``: the channels between smooth and balance layers (the balance layers' input features): the smooth
        layer's output channels, or the last ``C`` of them for a fused projection (:func:`fused_tail`)."""
        return int(self.balances[0].weight.shape[1]) if self.balances else smooth_channels(self.smooth)

    def describe(self) -> str:
        """``smooth -> balance, balance`` with names relative to the smooth layer's parent scope."""
        scope = _common_prefix([self.smooth_name, *self.balance_names])
        short = [n[len(scope) :] if scope else n for n in (self.smooth_name, *self.balance_names)]
        return f"{scope}{{{short[0]} -> {', '.join(short[1:])}}}" if scope else f"{short[0]} -> {', '.join(short[1:])}"


#: llm-compressor's name for a recipe mapping (``AWQMapping(smooth_layer, balance_layers)``), so that its scripts
#: translate by changing the import
AWQMapping = MappingSpec


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common: list[str] = []
    for items in zip(*parts, strict=False):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    if common and len(common) == min(len(p) for p in parts):
        common = common[:-1]
    return ".".join(common) + "." if common else ""


# --------------------------------------------------------------------------- recipe form
def parse_mappings(value: Any) -> list[MappingSpec] | None:
    """attrs converter: llm-compressor's ``mappings`` (either form) -> ``list[MappingSpec]`` (``None``: default).

    Accepted entries: ``[[balance patterns...], smooth pattern]`` (SmoothQuant's form; a single balance
    pattern may be a string), ``{smooth_layer: PATTERN, balance_layers: [PATTERNS...]}`` (AWQ's form;
    ``activation_hook_target`` only as null), a :class:`MappingSpec` (alias ``AWQMapping``), or any object with
    ``smooth_layer`` and ``balance_layers`` attributes (llm-compressor's own ``AWQMapping`` objects).

    Raises:
        ValueError: an empty list, or an entry of another shape (the message shows the expected forms).
    """
    if value is None:
        return None
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ValueError(_form_error(value))
    specs = [_parse_entry(entry) for entry in value]
    if not specs:
        msg = "mappings is empty: leave it out for the default mappings of the model's architecture, or give some"
        raise ValueError(msg)
    return specs


def _form_error(entry: Any) -> str:
    return (
        f"mappings: cannot read {entry!r}; give a list of [[balance layer patterns...], smooth layer pattern] "
        "(llm-compressor's SmoothQuant form) or of {smooth_layer: PATTERN, balance_layers: [PATTERNS...]} "
        "(its AWQ form)"
    )


def _patterns(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _parse_entry(entry: Any) -> MappingSpec:
    if isinstance(entry, MappingSpec):
        return entry
    if not isinstance(entry, Mapping) and hasattr(entry, "smooth_layer") and hasattr(entry, "balance_layers"):
        # another library's mapping object, e.g. llm-compressor's own AWQMapping dataclass
        entry = {
            k: getattr(entry, k)
            for k in ("smooth_layer", "balance_layers", "activation_hook_target")
            if hasattr(entry, k)
        }
    if isinstance(entry, Mapping):
        extra = set(entry) - {"smooth_layer", "balance_layers", "activation_hook_target"}
        if extra or entry.get("activation_hook_target") is not None:
            msg = f"mappings: {dict(entry)!r}: only smooth_layer and balance_layers are read "
            msg += f"({_HOOK_TARGET_UNSUPPORTED})"
            raise ValueError(msg)
        smooth, balances = entry.get("smooth_layer"), _patterns(entry.get("balance_layers"))
    elif isinstance(entry, list | tuple) and len(entry) == 2:
        balances, smooth = _patterns(entry[0]), entry[1]
    else:
        raise ValueError(_form_error(entry))
    if not isinstance(smooth, str) or not smooth or balances is None:
        raise ValueError(_form_error(entry))
    return MappingSpec(smooth, balances)


def mappings_to_recipe(specs: list[MappingSpec] | None) -> list[dict[str, Any]] | None:
    """``specs`` as plain data for recipe.yaml (the AWQ form), ``None`` for the default."""
    return None if specs is None else [s.to_recipe() for s in specs]


def mappings_to_smoothquant_recipe(specs: list[MappingSpec] | None) -> list[list[Any]] | None:
    """``specs`` as plain data for recipe.yaml in SmoothQuant's form (``[[balance patterns...], smooth pattern]``
    each), ``None`` for the default."""
    return None if specs is None else [s.to_smoothquant_recipe() for s in specs]


# --------------------------------------------------------------------------- model structure
def architecture(model: nn.Module) -> str:
    """``ClassName (model_type)`` of ``model`` for messages."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} ({model_type})" if model_type else type(model).__name__


def _is_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and "norm" in type(module).__name__.lower()


#: a norm's forward that scales by ``1 + weight`` (Gemma, Qwen3-Next, Qwen3.5: ``(1.0 + self.weight.float())``;
#: Nemotron: ``self.weight + 1.0``)
_ONE_PLUS_WEIGHT = re.compile(r"\(\s*1(\.0)?\s*\+\s*self\.weight\b|\bself\.weight(\.float\(\))?\s*\+\s*1(\.0)?\b")


def scales_by_one_plus_weight(module: nn.Module) -> bool:
    """Whether norm ``module`` multiplies its normalized input by ``1 + weight`` (read from its forward's source; a
    class whose source cannot be read counts as ``weight * f(x)``)."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return _ONE_PLUS_WEIGHT.search(source) is not None


def homogeneity_degree(act: Any) -> int | None:
    """``k`` such that ``act(y / t) == act(y) / t ** k`` for every ``t > 0`` (positive homogeneity), or ``None``.

    Known by the identity of ``act``'s class, not its name or config string: an instance of exactly
    ``transformers.activations.ReLUSquaredActivation`` (``relu(y) ** 2``, what ``ACT2FN["relu2"]`` builds:
    Nemotron-H's ``mlp_hidden_act``; So et al., Primer, arXiv 2109.08668) without an instance-level ``forward``
    gives ``2``; anything else (a subclass, SiLU, GELU, ``None``) ``None``. So a gateless ``down(act(up x))`` takes an
    exact fold: ``up``'s row ``j`` divided by ``s_j ** (1 / k)`` and ``down``'s column ``j`` multiplied by ``s_j``.
    """
    from transformers.activations import ReLUSquaredActivation

    if type(act) is ReLUSquaredActivation and "forward" not in vars(act):
        return 2
    return None


def smooth_channels(module: nn.Module) -> int:
    """Output channels of a smooth layer: a norm's weight size or a Linear's ``out_features``."""
    return int(module.weight.shape[0])


def fused_tail(name: str, module: nn.Module, channels: int) -> bool:
    """Whether the last ``channels`` output rows of Linear ``module`` are what a balance layer of ``channels`` input
    features reads: Phi-3's fused ``qkv_proj`` (rows ``[q; k; v]``) before ``o_proj`` when there are as many
    key/value heads as query heads (``3 * channels`` rows: ``v`` is the last third), and its fused ``gate_up_proj``
    (rows ``[gate; up]``, ``2 * channels``) before ``down_proj`` (``act(gate) * up`` is linear in ``up``), as
    llm-compressor's ``_phi_mappings`` smooth them (scaling the last rows); Granite's ``input_linear`` (rows
    ``[gate; up]``) before ``output_linear`` likewise. Whether the fold keeps the function is
    measured before smoothing (:func:`~llmc_fsm_quantization.smoothquant.fold_change`)."""
    if not is_linear_like(module) or module.weight.dim() != 2:
        return False
    rows = int(module.weight.shape[0])
    leaf = name.rsplit(".", 1)[-1]
    return (leaf == "qkv_proj" and rows == 3 * channels) or (
        leaf in ("gate_up_proj", "input_linear") and rows == 2 * channels
    )


def _find_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    try:
        return find_decoder_layers(model)
    except ValueError:
        return None


def _child(module: nn.Module, name: str) -> nn.Module | None:
    return module._modules.get(name)


def _linear_named(block: nn.Module, leaf: str, *, outside: str | None = None) -> tuple[str, nn.Module] | None:
    """The first Linear-like module of ``block`` whose name ends in ``leaf`` (``outside``: not under this child,
    e.g. the attention, whose output gate AFMoE and MuseGlimmer call ``gate_proj``, as an MLP calls its gate)."""
    for name, sub in block.named_modules():
        if outside is not None and name.startswith(outside + "."):
            continue
        if name.rsplit(".", 1)[-1] == leaf and is_linear_like(sub):
            return name, sub
    return None


def _default_specs_for_layer(layer: nn.Module, *, include_linear: bool) -> list[tuple[str, tuple[str, ...]]]:
    """``[(smooth name, balance names)]`` relative to ``layer``, for a Llama-style pre-norm decoder layer."""
    out: list[tuple[str, tuple[str, ...]]] = []
    children = dict(layer.named_children())
    post_norms = "pre_feedforward_layernorm" in children or "post_feedforward_layernorm" in children
    q = _linear_named(layer, "q_proj")
    k = _linear_named(layer, "k_proj")
    v = _linear_named(layer, "v_proj")
    o = _linear_named(layer, "o_proj")
    norms = [n for n, m in children.items() if _is_norm(m)]
    # a block of one norm and one mixer (Nemotron-H: attention, MLP, experts or mamba) uses it as either; not a
    # parallel block whose one norm feeds attention and MLP alike (GPT-J's ln_1: smoothing it for q/k/v alone would
    # change the MLP's input)
    only = norms[0] if len(norms) == 1 and len(children) == 2 and "input_layernorm" not in children else None
    norm_name = "input_layernorm" if only is None else only
    norm = _child(layer, norm_name)
    # Phi-3's fused q/k/v; Bloom's, GPT-NeoX's, Falcon's query_key_value (llm-compressor's Bloom mappings)
    qkv = None if (q or k or v) else (_linear_named(layer, "qkv_proj") or _linear_named(layer, "query_key_value"))
    attention = q[0].rpartition(".")[0] if q and "." in q[0] else None
    # a gated attention's output gate reads the norm's output too (AFMoE's, MuseGlimmer's self_attn.gate_proj)
    attention_gate = _linear_named(layer.get_submodule(attention), "gate_proj") if attention else None
    # a parallel layer whose MLP holds routed experts (Cohere2-MoE): its one norm feeds them too (their router,
    # shared expert and every expert's gate / up are balance layers beside q/k/v), unless the block is not resolved
    parallel = _parallel_mlp_inputs(layer, children, norms)
    experts_in_mlp = "mlp" in children and bool(_experts_modules(children["mlp"]))
    parallel_moe = norms == ["input_layernorm"] and experts_in_mlp and not parallel
    # Falcon-H1: attention and a mamba mixer side by side read the one pre-mixer norm (each times a scalar multiplier)
    mamba = _child(layer, "mamba")
    mamba_in = ("mamba.in_proj",) if mamba is not None and is_linear_like(_child(mamba, "in_proj")) else ()
    if norm is not None and _is_norm(norm) and q and k and v and not parallel_moe:
        gated = (f"{attention}.{attention_gate[0]}",) if attention_gate else ()
        out.append((norm_name, (q[0], k[0], v[0], *gated, *mamba_in, *parallel)))
    elif norm is not None and _is_norm(norm) and qkv and not parallel_moe:
        out.append((norm_name, (qkv[0], *parallel)))
    if include_linear and parallel and experts_in_mlp and norm is not None and _is_norm(norm):
        ups = (n for n in parallel if n.endswith(".up_proj") and n.count(".") > 2)  # mlp.experts.<e>.up_proj
        out.extend((n, (n.removesuffix("up_proj") + "down_proj",)) for n in ups if _is_expert_view(layer, n))
    linear_attn = _child(layer, "linear_attn")  # Qwen3-Next's / Qwen3.5's Gated DeltaNet: the norm feeds its in_proj_*
    if linear_attn is not None and not (q or k or v or qkv) and norm is not None and _is_norm(norm):
        projections = [
            f"linear_attn.{n}"
            for n, m in linear_attn.named_children()
            if n.startswith("in_proj_") and is_linear_like(m)
        ]  # llm-compressor's hybrid-attention mappings (in_proj_qkvz, in_proj_ba; in_proj_qkv, _z, _b, _a)
        if projections:
            out.append((norm_name, tuple(projections)))
    kv_a = _linear_named(layer, "kv_a_proj_with_mqa")  # DeepSeek-V2/V3's multi-head latent attention
    if kv_a and not (k or v or qkv) and norm is not None and _is_norm(norm):  # llm-compressor's DeepSeek mappings
        q_in = _linear_named(layer, "q_a_proj") or q  # q_proj without a q LoRA rank
        # DeepSeek-V3.2's / GLM-5's sparse-attention indexer reads the layer's normed input (wk, weights_proj) and the
        # q LoRA's normed latent (wq_b): beside the projections, or a fold would change its top-k
        indexer = {
            leaf: found[0]
            for leaf in ("wk", "weights_proj", "wq_b")
            if (found := _linear_named(layer, leaf)) is not None and found[0].rpartition(".")[0].endswith("indexer")
        }
        index_in = tuple(indexer[leaf] for leaf in ("wk", "weights_proj") if leaf in indexer)
        out.append((norm_name, (*(x[0] for x in (q_in, kv_a) if x), *index_in)))
        for latent_norm, reader in (("q_a_layernorm", "q_b_proj"), ("kv_a_layernorm", "kv_b_proj")):
            found_norm = next((n for n, m in layer.named_modules() if n.rsplit(".", 1)[-1] == latent_norm), None)
            found_reader = _linear_named(layer, reader)
            if found_norm and found_reader and _is_norm(layer.get_submodule(found_norm)):
                extra = (indexer["wq_b"],) if latent_norm == "q_a_layernorm" and "wq_b" in indexer else ()
                out.append((found_norm, (found_reader[0], *extra)))
    if include_linear and v and o and v[1].weight.shape[0] == o[1].weight.shape[1]:
        out.append((v[0], (o[0],)))
    if include_linear and qkv and o and fused_tail(qkv[0], qkv[1], int(o[1].weight.shape[1])):
        out.append((qkv[0], (o[0],)))
    gate = _linear_named(layer, "gate_proj", outside=attention)
    up = _linear_named(layer, "up_proj", outside=attention) or (
        None if gate else _linear_named(layer, "dense_h_to_4h")
    )  # Bloom, NeoX
    down = _linear_named(layer, "down_proj", outside=attention)
    if post_norms:
        mlp_norm_name = "pre_feedforward_layernorm"
    elif "pre_mlp_layernorm" in children:  # AFMoE: post_attention_layernorm normalises the attention's output
        mlp_norm_name = "pre_mlp_layernorm"
    elif only is not None and not (q and k and v):
        mlp_norm_name = only
    else:  # Llama-style; Jamba's pre_ff_layernorm
        mlp_norm_name = next((n for n in _MLP_NORMS if n in children), _MLP_NORMS[0])
    mlp_norm = _child(layer, mlp_norm_name)
    moe = _moe_block(layer)
    norm_fits = mlp_norm is not None and _is_norm(mlp_norm)
    # the up_proj found is a shared expert's: the norm feeds it, its gate and the router and experts alike
    shared = moe is not None and up is not None and up[0].startswith(moe[0] + ".")
    expert_views: list[str] = []
    if moe is not None and (not up or shared):
        block, experts, router = moe
        scope = f"{block}." if block else ""
        in_block = router.removeprefix(scope)
        if moe_mapping_problem(layer.get_submodule(block), experts, in_block) is None:
            expert_views = [f"{experts}.{suffix}" for suffix in weight_views(layer.get_submodule(experts))]
            readers = [scope + n for n in shared_expert_readers(layer.get_submodule(block), experts, in_block)]
            # Granite-MoE's shared_mlp beside the block reads the norm's output too (found by a tester: left out, the
            # fold check refused the default mapping); its fused [gate; up] input_linear -> output_linear is AWQ's
            hidden = int(layer.get_submodule(router).weight.shape[1])
            beside = _fused_mlps_beside(layer, block, hidden) if block else []
            if norm_fits:
                gate_up = (v for v in expert_views if not v.endswith(".down_proj"))
                out.append((mlp_norm_name, (router, *readers, *(i for i, _ in beside), *gate_up)))
                if include_linear:
                    out.extend((i, (o,)) for i, o in beside)
    elif norm_fits and up and not _beside_unknown_experts(layer, up[0]):
        out.append((mlp_norm_name, (gate[0], up[0]) if gate else (up[0],)))
    fused = None if (gate or up) else _linear_named(layer, "gate_up_proj")  # Phi-3's fused gate/up
    if norm_fits and fused and moe is None:
        out.append((mlp_norm_name, (fused[0],)))
    if include_linear and fused and down and fused_tail(fused[0], fused[1], int(down[1].weight.shape[1])):
        out.append((fused[0], (down[0],)))
    # up -> down is exact for down(act(gate) * up), and without a gate for a positively homogeneous act (Nemotron's
    # relu2(up): up's rows take s ** (1 / 2), :func:`homogeneity_degree`); another gateless act is left out (warned)
    gated = gate is not None and up is not None and gate[0].rpartition(".")[0] == up[0].rpartition(".")[0]
    if include_linear and gated and down and up[1].weight.shape[0] == down[1].weight.shape[1]:
        out.append((up[0], (down[0],)))
    if include_linear and not gated:
        out.extend((u, (d,)) for u, d, degree in _gateless_mlps(layer) if degree is not None)
    if include_linear and norm_fits:
        ups = (v for v in expert_views if v.endswith(".up_proj"))
        out.extend((v, (v.removesuffix("up_proj") + "down_proj",)) for v in ups)
    return out


def _parallel_mlp_inputs(layer: nn.Module, children: dict[str, nn.Module], norms: list[str]) -> tuple[str, ...]:
    """The MLP's input Linears of a parallel decoder layer, whose one norm (``input_layernorm``) feeds attention and
    MLP alike (Cohere, Cohere2: ``gate_proj``, ``up_proj``; Phi: ``fc1``; Falcon: ``dense_h_to_4h``), else ``()``:
    they are balance layers of that norm with ``q/k/v`` (llm-compressor's Cohere mappings), or folding its scales
    would change the MLP's input.

    A layer is taken as parallel when ``input_layernorm`` is its only norm, next to an ``mlp`` child; whether the
    fold keeps the function is measured before smoothing (:func:`~llmc_fsm_quantization.smoothquant.fold_change`).
    An ``mlp`` holding fused experts (Cohere2-MoE) gives its router, shared expert readers and every expert's
    ``gate_proj`` / ``up_proj`` view (a block :func:`moe_mapping_problem` accepts; else ``()``, and the layer's norm
    is left unsmoothed).
    """
    mlp = children.get("mlp")
    if norms != ["input_layernorm"] or mlp is None:
        return ()
    if _experts_modules(mlp):  # Cohere2-MoE: the router, shared expert and every expert's gate / up read it too
        moe = _moe_block(layer)
        if moe is None or moe[0] != "mlp":
            return ()
        block, experts, router = moe
        in_block = router.removeprefix(f"{block}.")
        if moe_mapping_problem(mlp, experts, in_block) is not None:
            return ()
        readers = [f"{block}.{n}" for n in shared_expert_readers(mlp, experts, in_block)]
        gate_up = [f"{experts}.{s}" for s in weight_views(layer.get_submodule(experts)) if not s.endswith("down_proj")]
        return (router, *readers, *gate_up)
    names = (
        [leaf for leaf in ("gate_proj", "up_proj") if is_linear_like(_child(mlp, leaf))]
        or [
            leaf
            for leaf in ("fc1", "dense_h_to_4h")
            if is_linear_like(_child(mlp, leaf))  # Phi; Falcon
        ][:1]
    )
    return tuple(f"mlp.{leaf}" for leaf in names)


def _is_expert_view(layer: nn.Module, name: str) -> bool:
    """Whether ``name`` in ``layer`` is an expert matrix of fused experts (``<experts>.<e>.<matrix>``)."""
    experts, _, suffix = name.rpartition(".")
    experts, _, index = experts.rpartition(".")
    try:
        module = layer.get_submodule(experts)
    except AttributeError:
        return False
    return f"{index}.{suffix}" in weight_views(module)


def _gateless_mlps(layer: nn.Module) -> list[tuple[str, str, int | None]]:
    """``(up, down, degree)`` for each module in ``layer`` computing ``down(act(up x))`` without a gate: children
    ``up_proj`` and ``down_proj`` (Linears, ``up.out == down.in``) and ``act_fn``, no ``gate_proj`` (Nemotron-H's MLP
    and shared expert); ``degree``: :func:`homogeneity_degree` of its ``act_fn``."""
    found = []
    for name, module in layer.named_modules():
        up, down, act = (_child(module, leaf) for leaf in ("up_proj", "down_proj", "act_fn"))
        if (
            _child(module, "gate_proj") is None
            and up is not None
            and down is not None
            and act is not None
            and is_linear_like(up)
            and is_linear_like(down)
            and up.weight.shape[0] == down.weight.shape[1]
        ):
            scope = f"{name}." if name else ""
            found.append((f"{scope}up_proj", f"{scope}down_proj", homogeneity_degree(act)))
    return found


def _fused_mlps_beside(layer: nn.Module, block: str, hidden: int) -> list[tuple[str, str]]:
    """``(input_linear, output_linear)`` names in ``layer`` of each child other than the mixture-of-experts ``block``
    that is Granite's MLP (GraniteMoeHybrid's, GraniteMoeShared's ``shared_mlp``, computing
    ``output_linear(act(gate) * up)`` with ``[gate; up] = input_linear(x)``): children ``input_linear`` (a Linear of
    ``hidden`` inputs and ``2 * I`` outputs) and ``output_linear`` (``I`` inputs), and no other parameter. That the
    layer feeds it the block's input is measured by the fold check before smoothing
    (:func:`~llmc_fsm_quantization.smoothquant.fold_change`), as whether its last ``I`` rows are the ``up`` half
    (:func:`fused_tail`)."""
    found = []
    for name, child in layer.named_children():
        first, second = _child(child, "input_linear"), _child(child, "output_linear")
        if name == block or not is_linear_like(first) or not is_linear_like(second):
            continue
        own = {id(p) for p in child.parameters()} == {id(p) for p in (*first.parameters(), *second.parameters())}
        if own and first.weight.shape[1] == hidden and first.weight.shape[0] == 2 * second.weight.shape[1]:
            found.append((f"{name}.input_linear", f"{name}.output_linear"))
    return found


#: a decoder layer's norm before its MLP or mixture-of-experts block, by name (Llama-style; Jamba)
_MLP_NORMS = ("post_attention_layernorm", "pre_ff_layernorm")


def _fused_experts(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the fused experts modules in ``layer`` (:func:`~llmc_fsm.toolkit.views.weight_views`)."""
    return [(n, m) for n, m in layer.named_modules() if n and weight_views(m) and "" not in weight_views(m)]


def _beside_unknown_experts(layer: nn.Module, name: str) -> bool:
    """Whether ``name`` (a shared expert's ``up_proj``, say) is in the block of fused experts :func:`_moe_block`
    does not resolve (AFMoE's router is ``mlp.router.gate``, inside a module of its own): the block's norm feeds the
    router and the experts too, so a mapping of the norm to the shared expert alone would change the model."""
    if _moe_block(layer) is not None:
        return False
    blocks = [n.rpartition(".")[0] for n in _experts_modules(layer)]
    return any(name.startswith(block + ".") if block else True for block in blocks)


def _experts_modules(layer: nn.Module) -> list[str]:
    """Names in ``layer`` of its routed experts: fused experts with views, or any module called ``experts`` holding
    parameters (Llama-4's ``Llama4TextExperts``)."""
    named = {n for n, _ in _fused_experts(layer)}
    named.update(
        n for n, m in layer.named_modules() if n.rsplit(".", 1)[-1] == "experts" and any(True for _ in m.parameters())
    )
    return sorted(named)


def _moe_block(layer: nn.Module) -> tuple[str, str, str] | None:
    """``(block, experts, router)`` names in ``layer`` of its one mixture-of-experts block with fused experts (the
    experts module's parent) and its one router (:func:`moe_router`)."""
    found = _fused_experts(layer)
    if len(found) != 1:
        return None
    experts_name = found[0][0]
    block = experts_name.rpartition(".")[0]
    router = moe_router(layer.get_submodule(block), experts_name.rpartition(".")[2])
    if not router:
        return None
    return block, experts_name, f"{block}.{router}" if block else router


def moe_router(block: nn.Module, experts: str) -> str:
    """The path in the mixture-of-experts ``block`` of its one router, or ``""`` (none, or several): a child with a
    2-D ``[num_experts, hidden]`` weight applied as a Linear (Mixtral's ``gate``, Llama 4's ``router``), else the one
    such Linear inside a child that holds no other parameter (AFMoE's ``router.gate``, HunYuan's ``gate.wg``: a
    router module computing its scores from that Linear's output). ``experts``: the name of the experts child."""
    count = getattr(block.get_submodule(experts), "num_experts", None)

    def fits(module: nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == count

    children = [(n, m) for n, m in block.named_children() if n != experts]
    direct = [n for n, m in children if fits(m)]
    if direct:
        return direct[0] if len(direct) == 1 else ""
    nested = []
    for name, module in children:
        inner = [(n, m) for n, m in module.named_children() if fits(m)]
        if len(inner) == 1 and {id(p) for p in module.parameters()} == {id(p) for p in inner[0][1].parameters()}:
            nested.append(f"{name}.{inner[0][0]}")
    return nested[0] if len(nested) == 1 else ""


def moe_mapping_problem(block: nn.Module, experts: str, router: str) -> str | None:
    """Why the mixture-of-experts ``block`` cannot take the shared smoothing scale of its input (one phrase), or
    ``None``: its ``experts`` (a fused experts module, the name of a child of ``block``) must be transformers'
    layout class without biases, either with a gate and transformers' own ``act(gate) * up`` or without a gate and a
    positively homogeneous ``act_fn`` (``down(relu2(up x))``, Nemotron-H: :func:`homogeneity_degree`), and ``block``
    must hold nothing else that reads the input but the ``router`` (its path in ``block``, :func:`moe_router`: a
    ``[num_experts, hidden]`` weight applied as a Linear) and shared experts (:func:`shared_expert_readers`)."""
    module = block.get_submodule(experts.rpartition(".")[2])
    kind = type(module).__name__
    layout = experts_layout(module)
    if layout is None:
        return (
            f"{kind} is neither a transformers fused-experts class with layout flags (has_gate, is_concatenated, ...) "
            "nor Llama 4's experts"
        )
    if not layout.has_gate and homogeneity_degree(getattr(module, "act_fn", None)) is None:
        act = type(getattr(module, "act_fn", None)).__name__
        return (
            f"{kind} has no gate rows and its act_fn {act} is not transformers' ReLUSquaredActivation (relu2): "
            "down(act(up x)) has no exact fold of an up -> down scale"
        )
    if layout.has_bias:
        return f"{kind} adds biases to its projections"
    apply_gate = getattr(type(module), "_apply_gate", None)  # Llama 4 has none: act(gate) * up in its forward
    if layout.has_gate and apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        return f"{kind} gates by its own _apply_gate, not act(gate) * up"
    if not router:
        children = ", ".join(n for n, _ in block.named_children())
        return (
            "no child of the block is one router with an [experts, hidden] weight, or holds one and nothing else "
            f"(children: {children})"
        )
    others = _other_children(block, experts, router)
    router_module = block.get_submodule(router)
    router_weight = getattr(router_module, "weight", None)
    if not isinstance(router_weight, torch.Tensor) or router_weight.dim() != 2:
        return f"its router {router} ({type(router_module).__name__}) holds no [experts, hidden] weight of its own"
    hidden = int(router_weight.shape[1])
    odd = [n for n, m in others.items() if _shared_reader_names(m, hidden) is None]
    if odd:
        return (
            f"the block also holds {', '.join(odd)}: neither its router, its experts, a shared expert (gate_proj, "
            "up_proj, down_proj Linears; or up_proj, down_proj without a gate) nor a shared expert's 1-output gate "
            "Linear (e.g. Nemotron-H's latent projection fc1_latent_proj between the block's input and its experts), "
            "so the scale of the block's input cannot be folded"
        )
    return None


def _other_children(block: nn.Module, experts: str, router: str) -> dict[str, nn.Module]:
    """``block``'s children with parameters other than its ``experts`` and the one holding its ``router`` (a path in
    ``block``)."""
    leaves = {experts.rpartition(".")[2], router.partition(".")[0]}
    return {n: m for n, m in block.named_children() if n not in leaves and any(True for _ in m.parameters())}


def _shared_reader_names(module: nn.Module, hidden: int) -> list[str] | None:
    """The names in ``module`` of what reads the block's input when ``module`` is a shared expert (its ``gate_proj``
    and ``up_proj``; without a gate, Nemotron-H's ``shared_experts``: its ``up_proj``) or a shared expert's gate (a
    Linear of 1 output: ``""``); ``None``: it is neither."""
    if is_linear_like(module):
        return [""] if tuple(module.weight.shape) == (1, hidden) else None
    gate, up, down = (_child(module, leaf) for leaf in ("gate_proj", "up_proj", "down_proj"))
    if gate is None and up is not None and down is not None and is_linear_like(up) and is_linear_like(down):
        fits = up.weight.shape[1] == hidden and down.weight.shape[1] == up.weight.shape[0]
        only = set(dict(module.named_children())) == {"up_proj", "down_proj", "act_fn"}
        return ["up_proj"] if fits and only else None
    if not all(p is not None and is_linear_like(p) for p in (gate, up, down)):
        return None
    if (
        gate.weight.shape != up.weight.shape
        or gate.weight.shape[1] != hidden
        or down.weight.shape[1] != up.weight.shape[0]
    ):
        return None
    return ["gate_proj", "up_proj"]


def shared_expert_readers(block: nn.Module, experts: str, router: str) -> list[str]:
    """Names in ``block`` (a block :func:`moe_mapping_problem` accepts, ``router`` its router's path in it) of the
    shared expert modules that read its
    input beside the router and the routed experts: a shared expert's ``gate_proj`` and ``up_proj`` (DeepSeek-V3's
    ``shared_experts``, Qwen3-Next's ``shared_expert``; ``up_proj`` alone without a gate, Nemotron-H's) and the
    shared expert's gate (Qwen3-Next's ``shared_expert_gate``), in the block's order; ``[]`` without a shared
    expert."""
    hidden = int(block.get_submodule(router).weight.shape[1])  # checked by moe_mapping_problem
    found = []
    for name, module in _other_children(block, experts, router).items():
        found += [f"{name}.{leaf}" if leaf else name for leaf in _shared_reader_names(module, hidden) or []]
    return found


def default_mappings(
    model: nn.Module, *, include_linear: bool = True, warned: set[str] | None = None
) -> list[ResolvedMapping]:
    """The default mappings of ``model`` (table in the module docstring), decoder layer by decoder layer.

    Args:
        include_linear: also the Linear-to-Linear mappings (``v_proj -> o_proj``, ``up_proj -> down_proj``;
            AWQ's defaults); ``False``: the norm mappings only (SmoothQuant's defaults, the inputs of the
            attention and MLP input projections, paper Sec. 4).

        warned: the warnings given already (a modifier's own set, which also spans the ``meta``-device model its
            checks run on first); ``None``: once per model object.

    Returns:
        ``[]`` when no decoder layer has a mapping that fits (the caller raises, see :func:`resolve_mappings`).
    """
    found = _find_layers(model)
    if found is None:
        return []
    layers_name, layers = found
    mappings: list[ResolvedMapping] = []
    for index, layer in enumerate(layers):
        prefix = f"{layers_name}.{index}."
        specs = _default_specs_for_layer(layer, include_linear=include_linear)
        if not specs:
            continue
        experts = dict(_fused_experts(layer))
        views = {f"{n}.{s}": v for n, m in experts.items() for s, v in weight_views(m).items()}
        for smooth, balances in specs:
            named = {name: _lookup(layer, views, name) for name in (smooth, *balances)}
            mapping = _resolved(layer, prefix, smooth, list(balances), named)
            if _fit_problem(mapping) is None:
                mappings.append(mapping)
    given = warned if warned is not None else ({"*"} if _WARNED.get(model) else set())

    def warn(text: str) -> None:
        if text not in given and "*" not in given:
            logger.warning("%s", text)
        given.add(text)

    left = unsmoothed_mixers(model, mappings)
    if mappings and left:
        warn(
            f"default smoothing mappings: no mapping reaches {compact_names(list(left))} "
            f"({', '.join(sorted({type(m).__name__ for m in left.values()}))}): their Linears are not smoothed (a "
            "quantizer quantizes them as they are)"
        )
    gateless: dict[str, str] = {}  # a gateless MLP's up_proj -> its act's class, where no exact fold is known
    for index, layer in enumerate(layers if include_linear else []):
        for up, _, degree in _gateless_mlps(layer):
            if degree is None:
                act = layer.get_submodule(up.removesuffix("up_proj") + "act_fn")
                gateless[f"{layers_name}.{index}.{up}"] = type(act).__name__
    if mappings and gateless:
        warn(
            f"default smoothing mappings: {compact_names(list(gateless))} -> down_proj left out: without a gate, "
            f"down({', '.join(sorted(set(gateless.values())))}(up x)) is invariant to a fold only for a positively "
            "homogeneous act (transformers' relu2); their down_proj is quantized without smoothing"
        )
    if mappings:
        _WARNED[model] = True  # once per model: the modifiers resolve the mappings at each stage of their lifecycle
    return mappings


def unsmoothed_mixers(model: nn.Module, mappings: Iterable[ResolvedMapping]) -> dict[str, nn.Module]:
    """``{name: module}`` of the decoder layers' children that hold Linears none of which is a balance layer of
    ``mappings`` (e.g. Jamba's and Nemotron-H's mamba mixers: their ``in_proj`` reads the norm through no mapping
    the defaults know), in the model's order; ``{}`` without decoder layers."""
    found = _find_layers(model)
    if found is None:
        return {}
    reached = {id(b) for m in mappings for b in m.balances}
    layers_name, layers = found
    left: dict[str, nn.Module] = {}
    for index, layer in enumerate(layers):
        for name, child in layer.named_children():
            linears = [m for m in child.modules() if is_linear_like(m)]
            if linears and not any(id(m) in reached for m in linears):
                left[f"{layers_name}.{index}.{name}"] = child
    return left


def _resolved(
    root: nn.Module, prefix: str, smooth: str, balance_names: list[str], modules: dict[str, nn.Module]
) -> ResolvedMapping:
    """The mapping ``smooth -> balance_names`` (names relative to ``root``, ``modules`` holds at least the balance
    layers; the smooth layer and the parent are looked up in ``modules``, then in ``root``)."""
    if len(balance_names) == 1:
        parent = balance_names[0]
    else:
        parent = _common_prefix(balance_names).rstrip(".")
    # not a ModuleList (several experts' Linears of a list of expert MLPs): it has no forward, its holder has
    while parent and isinstance(_lookup(root, modules, parent), nn.ModuleList):
        parent = parent.rpartition(".")[0]
    views = [modules[n] for n in (smooth, *balance_names) if isinstance(modules.get(n), LinearView)]
    smooth_module = _lookup(root, modules, smooth)
    if not isinstance(getattr(smooth_module, "weight", None), torch.Tensor):
        msg = (
            f"smoothing mapping {prefix + smooth} -> {', '.join(prefix + n for n in balance_names)}: the smooth layer "
            f"({type(smooth_module).__name__}) has no weight to fold the scales into; a smooth layer is a norm or a "
            "Linear: leave the mapping out"
        )
        raise ValueError(msg)
    return ResolvedMapping(
        smooth_name=prefix + smooth,
        smooth=smooth_module,
        balance_names=tuple(prefix + n for n in balance_names),
        balances=tuple(modules[n] for n in balance_names),
        parent_name=(prefix + parent).rstrip("."),
        parent=_lookup(root, modules, parent) if parent else root,
        experts=views[0].source if views else None,
        degree=_fold_degree(root, smooth, smooth_module),
    )


def _fold_degree(root: nn.Module, smooth_name: str, smooth: nn.Module) -> int | None:
    """:attr:`ResolvedMapping.degree` of a mapping from ``smooth`` (``smooth_name`` relative to ``root``): an expert's
    ``up_proj`` rows of gateless fused experts, or an ``up_proj`` Linear whose module has a ``down_proj`` and no
    ``gate_proj``, take the :func:`homogeneity_degree` of the ``act_fn`` between them; anything else ``1``."""
    if isinstance(smooth, LinearView) and smooth.expert is not None:
        source = smooth.source
        gateless = getattr(source, "has_gate", True) is False and smooth.param_name == "up_proj"
        return homogeneity_degree(getattr(source, "act_fn", None)) if gateless else 1
    scope, _, leaf = smooth_name.rpartition(".")
    if smooth.weight.dim() != 2 or leaf != "up_proj":
        return 1
    module = root.get_submodule(scope) if scope else root
    if _child(module, "gate_proj") is not None or _child(module, "down_proj") is None:
        return 1
    return homogeneity_degree(_child(module, "act_fn"))


def _lookup(root: nn.Module, modules: Mapping[str, nn.Module], name: str) -> nn.Module:
    """``modules[name]`` (a view of a fused expert matrix, not a submodule), else ``root``'s submodule ``name``."""
    found = modules.get(name)
    return found if found is not None else root.get_submodule(name)


def _fit_problem(mapping: ResolvedMapping) -> str | None:
    """Why ``mapping`` cannot be smoothed (one phrase), or ``None``."""
    smooth = mapping.smooth
    if not _is_norm(smooth) and not is_linear_like(smooth):
        return f"{mapping.smooth_name} ({type(smooth).__name__}) is neither a norm with a 1-D weight nor a Linear"
    if mapping.degree is None:
        return (
            f"{mapping.smooth_name} -> {', '.join(mapping.balance_names)}: without a gate, down(act(up x)) is "
            "invariant to a fold only for a positively homogeneous act (transformers' relu2)"
        )
    channels = smooth_channels(smooth)
    if mapping.balances and fused_tail(mapping.smooth_name, smooth, int(mapping.balances[0].weight.shape[1])):
        channels = int(mapping.balances[0].weight.shape[1])
    for name, balance in zip(mapping.balance_names, mapping.balances, strict=True):
        router = (
            mapping.experts is not None
            and balance.weight.dim() == 2
            and balance.weight.shape[0] == getattr(mapping.experts, "num_experts", None)
        )
        if not is_linear_like(balance) and not router:
            return f"{name} ({type(balance).__name__}) is not a Linear"
        if int(balance.weight.shape[1]) != channels:
            fused = mapping.smooth_name.rsplit(".", 1)[-1] in ("qkv_proj", "gate_up_proj")
            why = (
                " (a fused projection is smoothed through its last rows only when they are exactly what the balance "
                "layer reads: 3 x its input for qkv_proj, i.e. as many key/value heads as query heads; 2 x for "
                "gate_up_proj)"
                if fused
                else ""
            )
            return (
                f"{mapping.smooth_name} has {channels} output channels but {name} reads {balance.weight.shape[1]}{why}"
            )
    return None


# --------------------------------------------------------------------------- recipe mappings
def _scopes(name: str) -> list[str]:
    """Enclosing module names of ``name``, innermost first (``a.b.c`` -> ``a.b``, ``a``, ``""``)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _output_projection_misfit(mapping: ResolvedMapping) -> bool:
    """Whether ``mapping`` is a misfit llm-compressor 0.14's AWQ skips itself (``_check_layers_are_compatible``): a
    Linear ``v_proj`` whose output is not ``o_proj``'s input, or ``qkv_proj`` whose output is not 3 x it (grouped-query
    attention; its default ``v_proj -> o_proj`` mapping, which its saved recipes record, meets them on most models)."""
    smooth = mapping.smooth
    if not isinstance(smooth, nn.Linear):
        return False
    for name, balance in zip(mapping.balance_names, mapping.balances, strict=True):
        if not isinstance(balance, nn.Linear) or not name.endswith(".o_proj"):
            continue
        if mapping.smooth_name.endswith(".v_proj") and smooth.out_features != balance.in_features:
            return True
        if mapping.smooth_name.endswith(".qkv_proj") and smooth.out_features != 3 * balance.in_features:
            return True
    return False


def _spans_layers(scope: str, layers_name: str | None) -> bool:
    """Whether module ``scope`` holds the decoder layers' list (or is unknown to hold none: ``layers_name`` ``None``),
    i.e. a balance pattern's matches under it may come from several decoder layers."""
    return layers_name is None or not scope or layers_name == scope or layers_name.startswith(scope + ".")


def _resolve_spec(
    model: nn.Module, named: list[tuple[str, nn.Module]], spec: MappingSpec, ignore: list[str]
) -> tuple[list[ResolvedMapping], list[str], list[str], int, int]:
    """The resolutions of ``spec`` in ``model``, why patterns matched nothing, why matched modules did not fit
    (shapes: e.g. ``v_proj -> o_proj`` under grouped-query attention), how many of those misfits llm-compressor's AWQ
    skips itself (:func:`_output_projection_misfit`) and how many smooth layers ``ignore`` left out.

    For each smooth layer, every balance pattern is looked up in the innermost module enclosing it where each pattern
    matches; there every match of a pattern is a balance layer (llm-compressor 0.14's ``match_modules_set`` takes all
    matches within the smooth layer's parent context: ``re:.*self_attn\\.(q|k|v)_proj$`` is ``q_proj``, ``k_proj``,
    ``v_proj``), unless that module holds the decoder layers (a final norm's nearest ``q_proj`` are every layer's):
    then a pattern matching several Linears (other than the experts of one fused experts module) is a misfit."""
    # a fused experts module matches through its parameters' names (gate_up_proj): its views stand for it
    smooth_matches = [(n, m) for n, m in named if n and matches(n, m, spec.smooth_layer) and not _fused(m)]
    resolved: list[ResolvedMapping] = []
    problems: list[str] = []
    misfits: list[str] = []
    ignored = 0
    incompatible = 0
    routers = set(router_names(named))
    index = {n: i for i, (n, _) in enumerate(named)}
    found_layers = _find_layers(model)
    layers_name = found_layers[0] if found_layers is not None else None
    for smooth_name, smooth in smooth_matches:
        chosen: dict[str, nn.Module] | None = None
        missing = ""  # the balance pattern that matched nothing in the widest scope tried
        for scope in _scopes(smooth_name):
            inside = [(n, m) for n, m in named if n != smooth_name and (not scope or n.startswith(scope + "."))]
            found: dict[str, nn.Module] = {}
            ambiguous = ""
            for pattern in spec.balance_layers:
                hits = [(n, m) for n, m in inside if matches(n, m, pattern) and (is_linear_like(m) or n in routers)]
                if not hits:
                    missing = pattern
                    break
                if (
                    len(hits) > 1
                    and not ambiguous
                    and _spans_layers(scope, layers_name)
                    and not _one_experts_module([m for _, m in hits])
                ):
                    shown = compact_names([n for n, _ in hits])
                    ambiguous = f"{pattern!r} matches {len(hits)} Linears around {smooth_name} ({shown})"
                found.update(hits)
            else:
                chosen = found
                break
        if chosen is None:  # name the pattern that failed (a tester read the message as all of them failing)
            anywhere = any(matches(n, m, missing) and (is_linear_like(m) or n in routers) for n, m in named)
            where = "around it" if anywhere else "in the model"
            problems.append(
                f"{smooth_name}: no Linear matching {missing!r} {where} (balance layers {list(spec.balance_layers)})"
            )
            continue
        if ambiguous:  # several decoder layers' modules for one pattern: not this smooth layer's readers
            misfits.append(ambiguous)
            continue
        if _ignored_mapping(smooth_name, smooth, chosen, ignore):
            logger.info("mapping %s -> %s skipped: ignored", smooth_name, ", ".join(chosen))
            ignored += 1
            continue
        # the model's order, views after the modules (the default mappings' order: the router, then the experts)
        names = sorted(chosen, key=lambda n: (isinstance(chosen[n], LinearView), index[n]))
        mapping = _resolved(model, "", smooth_name, names, {**chosen, smooth_name: smooth})
        problem = _fit_problem(mapping)
        if problem is not None:
            misfits.append(problem)
            incompatible += _output_projection_misfit(mapping)
            continue
        problem = _expert_problem(mapping, named)
        if problem is not None:
            problems.append(problem)
            continue
        resolved.append(mapping)
    if not smooth_matches:
        problems.append(f"the smooth layer pattern {spec.smooth_layer!r} matches no module")
    return resolved, problems, misfits, incompatible, ignored


def _fused(module: nn.Module) -> bool:
    views = weight_views(module)
    return bool(views) and "" not in views


def _one_experts_module(modules: list[nn.Module]) -> bool:
    """Whether ``modules`` are all views of expert matrices of one fused experts module."""
    sources = {id(m.source) for m in modules if isinstance(m, LinearView) and m.expert is not None}
    return len(sources) == 1 and all(isinstance(m, LinearView) for m in modules)


def _named_with_views(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()``, each fused experts module followed by the views of its expert matrices
    (``<experts>.<e>.gate_proj``, ...: :func:`~llmc_fsm.toolkit.weight_views`)."""
    named: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        named.append((name, module))
        if _fused(module):
            named.extend((f"{name}.{suffix}", view) for suffix, view in weight_views(module).items())
    return named


def _expert_problem(mapping: ResolvedMapping, named: list[tuple[str, nn.Module]]) -> str | None:
    """Why a recipe mapping reaching expert matrices cannot be smoothed as the default mixture-of-experts mappings
    are (one phrase naming the modules), or ``None`` (it reaches none, or it is one of those mappings)."""
    if mapping.experts is None:
        return None
    names = {id(m): n for n, m in named}
    experts_name = names[id(mapping.experts)]
    block_name = experts_name.rpartition(".")[0]
    block = next(m for n, m in named if n == block_name)
    leaf = experts_name.rpartition(".")[2]
    router = moe_router(block, leaf)
    if not router:
        routers = [n for n in router_names(named) if n.startswith(block_name + ".")]
        return f"{experts_name}: its block {block_name} has {len(routers)} routers, not one"
    problem = moe_mapping_problem(block, leaf, router)
    if problem is not None:
        return f"{experts_name}: {problem}"
    views = {f"{experts_name}.{suffix}": v for suffix, v in weight_views(mapping.experts).items()}
    balances = set(mapping.balance_names)
    if mapping.smooth.weight.dim() == 1:  # a norm: the router and every expert's gate and up rows read its output
        shared = [f"{block_name}.{n}" for n in shared_expert_readers(block, leaf, router)]
        readers = {f"{block_name}.{router}", *shared, *(n for n in views if not n.endswith(".down_proj"))}
        missing = sorted(readers - balances)
        wrong = sorted(balances - readers)
        if missing:
            return (
                f"{mapping.smooth_name} also feeds {compact_names(missing)}, which the mapping leaves out: its scale "
                f"must be folded into every module reading it (balance_layers: the router, e.g. 're:.*mlp.gate$', "
                "and every expert's gate_proj and up_proj)"
            )
        if wrong:
            return f"{compact_names(wrong)} do not read the output of {mapping.smooth_name}"
        return None
    smooth, (balance, *others) = mapping.smooth_name, mapping.balance_names
    if not smooth.endswith(".up_proj") or others or balance != smooth.removesuffix("up_proj") + "down_proj":
        return (
            f"{smooth} -> {', '.join(mapping.balance_names)}: an expert's scaled rows can be folded only as its "
            "up_proj -> its own down_proj"
        )
    return None


def _ignored_mapping(smooth_name: str, smooth: nn.Module, balances: dict[str, nn.Module], ignore: list[str]) -> bool:
    """Whether ``ignore`` leaves a mapping out: its smooth layer or every one of its balance layers is ignored.

    An ignored balance layer of a mapping that is kept stays in it: it absorbs the inverse scale in its float weights
    (so the model computes what it did) and is not quantized -- e.g. a mixture-of-experts router in ``ignore``, as
    llm-compressor's MoE recipes write it (``re:.*mlp.gate$``), while the experts reading the same norm are smoothed.
    llm-compressor 0.14's AWQ resolves its mappings regardless of ``ignore`` and skips those whose layers none is
    quantized; its SmoothQuant skips those whose smooth layer is ignored.
    """
    if any(matches(smooth_name, smooth, p) for p in ignore):
        return True
    return all(any(matches(n, b, p) for p in ignore) for n, b in balances.items())


def resolve_mappings(
    model: nn.Module,
    specs: list[MappingSpec] | None,
    *,
    owner: str,
    ignore: list[str] | None = None,
    include_linear: bool = True,
    warned: set[str] | None = None,
    skip_incompatible: bool = False,
) -> list[ResolvedMapping]:
    """The mappings of ``model``: ``specs`` (a recipe's ``mappings``) or the defaults; checked, pure.

    Reads module names, classes and weight shapes only (works on a ``meta`` model), changes nothing.

    Args:
        specs: ``None`` for :func:`default_mappings`.
        owner: the modifier's name, for messages.
        ignore: module patterns (full names, class names, ``re:``); a mapping whose smooth layer or every balance
            layer is ignored is skipped; an ignored balance layer of another mapping stays in it (its float weights
            absorb the scale, so every reader of the smooth layer is compensated; see :func:`_ignored_mapping`).
        include_linear: see :func:`default_mappings`.
        warned: the skip warnings given already (a modifier's own set: its mappings are resolved by each check and at
            initialize); a warning in it is not logged again, a new one is added.
        skip_incompatible: AWQ's: a recipe mapping that fits no smooth layer only through the misfits
            llm-compressor 0.14's AWQ skips itself (:func:`_output_projection_misfit`: ``v_proj -> o_proj`` under
            grouped-query attention, from its default mappings, which its saved recipes record) is skipped with a
            warning, not refused.

    Returns:
        The mappings in the order of their first balance layer in the model, each smooth layer once.

    Raises:
        ValueError: no default mapping fits the model (naming the architecture and the decoder layer's modules);
            a recipe mapping whose smooth or balance patterns match no module (naming the pattern); a recipe mapping
            that fits none of the smooth layers it matches (naming it and why, e.g. ``o_proj -> v_proj`` in
            SmoothQuant's form under grouped-query attention; but see ``skip_incompatible``; one that fits some
            layers only is skipped at the others, with a warning);
            ``ignore`` leaving out every recipe mapping; a smooth layer in two mappings.
    """
    ignore = list(ignore or [])
    if specs is None:
        mappings = [
            m
            for m in default_mappings(model, include_linear=include_linear, warned=warned)
            if not _ignored_mapping(
                m.smooth_name, m.smooth, dict(zip(m.balance_names, m.balances, strict=True)), ignore
            )
        ]
        if not mappings:
            raise ValueError(_no_default_message(model, owner))
    else:
        named = _named_with_views(model)
        mappings = []
        skipped: list[str] = []  # the recipe's mappings skipped at every smooth layer, with why
        for spec in specs:
            found, problems, misfits, incompatible, ignored = _resolve_spec(model, named, spec, ignore)
            if problems:
                msg = (
                    f"{owner}: mapping {spec.to_recipe()} fits no module of {architecture(model)}: "
                    f"{'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}"
                )
                raise ValueError(msg)
            tolerated = skip_incompatible and incompatible == len(misfits)
            if misfits and not found and not ignored and not tolerated:  # it would smooth nothing: say so now
                msg = (
                    f"{owner}: mapping {spec.to_recipe()} fits none of the {len(misfits)} smooth layers it matches "
                    f"in {architecture(model)}: {misfits[0]}; correct its patterns or leave it out of the mappings"
                )
                raise ValueError(msg)
            if misfits:
                warning = (
                    f"{owner}: mapping {spec.to_recipe()} skipped at {len(misfits)} of {len(misfits) + len(found)} "
                    f"smooth layers: {misfits[0]}"
                )
                if warned is None or warning not in warned:
                    logger.warning("%s", warning)
                if warned is not None:
                    warned.add(warning)
                if not found:
                    skipped.append(f"{spec.to_recipe()}: {misfits[0]}")
            mappings.extend(found)
        if not mappings and skipped:
            msg = f"{owner}: no mapping of the recipe fits {architecture(model)}: {skipped[0]}"
            raise ValueError(msg)
        if not mappings:
            msg = (
                f"{owner}: ignore {ignore} leaves out every mapping of the recipe in {architecture(model)}, so "
                "nothing would be smoothed; narrow ignore or leave the modifier out"
            )
            raise ValueError(msg)
        order = {name: i for i, (name, _) in enumerate(named)}
        # a layer's balance layers are registered in call order (a router may come after its experts: Qwen3-MoE)
        mappings.sort(key=lambda m: min(order[n] for n in m.balance_names))
    seen: dict[str, str] = {}
    for mapping in mappings:
        if mapping.smooth_name in seen:
            msg = (
                f"{owner}: {mapping.smooth_name} is the smooth layer of two mappings (-> {seen[mapping.smooth_name]} "
                f"and -> {', '.join(mapping.balance_names)}); give each smooth layer once, with all its balance layers"
            )
            raise ValueError(msg)
        seen[mapping.smooth_name] = ", ".join(mapping.balance_names)
    return mappings


def _no_default_message(model: nn.Module, owner: str) -> str:
    found = _find_layers(model)
    if found is None:
        where = "it has no decoder layers (an nn.ModuleList of same-class blocks)"
    else:
        layers_name, layers = found
        layer = layers[0]
        norms = [n for n, m in layer.named_modules() if n and _is_norm(m)]
        linears = [n for n, m in layer.named_modules() if n and is_linear_like(m)]
        where = (
            f"its decoder layer {layers_name}.0 ({type(layer).__name__}) has norms "
            f"[{', '.join(norms) or 'none'}] and Linears [{', '.join(linears) or 'none'}]"
        )
    return (
        f"{owner}: no smoothing mapping fits {architecture(model)}: {where}; the default mappings need a "
        "Llama-style pre-norm layer (input_layernorm -> q_proj/k_proj/v_proj, post_attention_layernorm -> "
        "gate_proj/up_proj). Give the recipe's mappings, e.g. [{smooth_layer: 're:.*<norm>$', balance_layers: "
        "['re:.*<linear>$', ...]}]"
    )


def describe_mappings(mappings: list[ResolvedMapping]) -> list[str]:
    """One line per distinct mapping shape: ``smooth -> balances`` with layer indices folded (``{0..29}``); the
    expert matrices of fused experts counted per name (``gate_proj (4 experts)``), a module named as one of them
    shown with its parent (``shared_expert.gate_proj``: it was counted as a fifth expert, found by a tester)."""
    groups: dict[str, list[str]] = {}
    for m in mappings:
        experts = {
            n.rsplit(".", 1)[-1]
            for n, b in zip(m.balance_names, m.balances, strict=True)
            if isinstance(b, LinearView) and b.expert is not None
        }
        leaves: dict[str, int] = {}
        for n, b in zip(m.balance_names, m.balances, strict=True):
            leaf = n.rsplit(".", 1)[-1]
            if leaf in experts and not (isinstance(b, LinearView) and b.expert is not None):
                leaf = ".".join(n.split(".")[-2:])
            leaves[leaf] = leaves.get(leaf, 0) + 1
        balances = ", ".join(f"{leaf} ({count} experts)" if count > 1 else leaf for leaf, count in leaves.items())
        key = f"{m.smooth_name.rsplit('.', 1)[-1]} -> {balances}"
        groups.setdefault(key, []).append(m.smooth_name)
    return [f"{key} ({len(names)}x: {compact_names(names)})" for key, names in groups.items()]


# --------------------------------------------------------------------------- folding
@torch.no_grad()
def fold_scales(mapping: ResolvedMapping, scales: torch.Tensor) -> None:
    """Fold per-channel ``scales`` into ``mapping``: the smooth layer's output channel ``j`` divided by
    ``scales[j]``, every balance layer's input column ``j`` multiplied by it (the float function is unchanged).

    Norm: ``weight /= s`` (and ``bias``); a norm scaling by ``1 + weight`` (:func:`scales_by_one_plus_weight`):
    ``weight = (1 + weight) / s - 1``. Linear smooth layer: row ``j`` of ``weight`` (and ``bias[j]``; of a fused
    projection, :func:`fused_tail`, its ``j``-th of the last ``C`` rows) ``/= s_j ** (1 / k)``,
    ``k`` = :attr:`ResolvedMapping.degree` (``1`` but for a gateless ``up -> down`` through relu2, ``k = 2``:
    ``relu2((W_j x + b_j) / sqrt(s_j)) = relu2(W_j x + b_j) / s_j``, which the balance layer's column ``j`` times
    ``s_j`` restores). Computed in float32, or in float64 for float64 ``scales`` (AWQ's ``duo_scaling``
    candidates, as llm-compressor 0.14's ``_apply_smoothing`` multiplies by them), and written back in each
    parameter's dtype (rounded once).

    Args:
        scales: ``[C]`` positive floats (``C`` = :attr:`ResolvedMapping.channels`).

    Raises:
        ValueError: wrong shape, a scale that is not finite and positive, or a mapping of ``degree`` ``None`` (no
            exact fold; nothing changed).
    """
    channels = mapping.channels
    if scales.shape != (channels,):
        raise ValueError(f"scales of shape {tuple(scales.shape)} for {mapping.smooth_name} with {channels} channels")
    compute = torch.promote_types(scales.dtype, torch.float32)
    s = scales.detach().to(compute)
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"scales for {mapping.smooth_name} must be finite and positive")
    if mapping.degree is None:
        raise ValueError(f"{_fit_problem(mapping)}: no scales can be folded into it")
    smooth = mapping.smooth
    w = smooth.weight
    # the smooth layer's rows: s ** (1 / k) (k = 2 through relu2), so the balance layers' input is divided by s
    rows = s if mapping.degree == 1 or w.dim() == 1 else s.pow(1.0 / mapping.degree)
    if w.dim() == 1 and scales_by_one_plus_weight(smooth):  # (1 + w') = (1 + w) / s
        w.copy_(((1.0 + w.to(compute)) / s.to(w.device) - 1.0).to(w.dtype))
    elif w.dim() == 1:
        w.copy_((w.to(compute) / s.to(w.device)).to(w.dtype))
    else:  # a fused projection's last C rows (fused_tail); all of them otherwise
        w[-channels:].copy_((w[-channels:].to(compute) / rows.to(w.device)[:, None]).to(w.dtype))
    bias = getattr(smooth, "bias", None)
    if isinstance(bias, torch.Tensor):
        tail = bias[-channels:] if w.dim() == 2 else bias
        tail.copy_((tail.to(compute) / rows.to(bias.device)).to(bias.dtype))
    for balance in mapping.balances:
        bw = balance.weight
        bw.copy_((bw.to(compute) * s.to(bw.device)[None, :]).to(bw.dtype))
