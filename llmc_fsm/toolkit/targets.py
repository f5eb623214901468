"""Which modules a modifier compresses: ``targets`` minus ``ignore``, tied weights honoured.

Patterns follow llm-compressor / compressed-tensors (``compressed_tensors.utils.match``),
so a recipe written for llm-compressor selects the same modules here. A pattern
matches a module called ``name`` when:

* it is ``"re:<regex>"`` and ``re.match(regex, name)`` succeeds -- anchored at the
  start only, like llm-compressor: ``re:.*mlp`` matches ``model.layers.0.mlp.up_proj``
  and ``re:model.layers.1`` also matches ``model.layers.10``; end the regex with
  ``$`` to anchor it at the end;
* it equals ``name`` exactly (``"lm_head"``, ``"model.layers.0.mlp.down_proj"``);
* it equals the name of the module's class or of any ``nn.Module`` base class
  (``"Linear"`` also matches subclasses of ``nn.Linear``);
* ``re:`` or exact, it matches one of the module's own parameters by full name
  (``"<name>.weight"``), as llm-compressor's parameter targets do
  (``re:.*q_proj.weight``);
* it is one of llm-compressor's ``__ALL__``, ``__ALL_PRUNABLE__``, ``__ALL_QUANTIZABLE__``
  (every module).

A pattern that matches a container (``LlamaMLP``, a decoder layer, the model)
selects the supported modules inside it, and an ``ignore`` pattern that matches a
container ignores everything inside it. Only modules with a supported weight are
ever selected: by default Linear-like modules (a 2-D ``[out_features, in_features]``
weight and an ``in_features`` attribute equal to its second dimension) -- so
``Embedding`` and norms are never selected.

Weights kept otherwise than as one Linear each -- ``transformers``' ``Conv1D`` (GPT-2's
projections, weight stored ``[in, out]``) and fused mixture-of-experts weights (transformers 5's
3-D ``gate_up_proj`` / ``down_proj``, DBRX's ``w1`` / ``v1`` / ``w2``) -- are selected as
:class:`~llmc_fsm.toolkit.views.LinearView` per matrix when the caller asks for ``views``
(the pruning modifiers; ``"Linear"`` names them, as users expect), and refused before any work
otherwise (quantizers: the message says why) unless ``ignore`` excludes them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch
from torch import nn

from llmc_fsm.toolkit.views import LinearView, fused_experts_reason, router_names, weight_views

__all__ = [
    "ALL_MODULES",
    "DEFAULT_IGNORE",
    "DEFAULT_TARGETS",
    "QUANTIZED_CONFIG_KEYS",
    "TargetSelection",
    "check_not_quantized",
    "compact_names",
    "config_quantization",
    "is_linear_like",
    "is_peft_tuner_layer",
    "llmcompressor_module",
    "match_precedence",
    "matches",
    "refuse_llmcompressor_modules",
    "resolve_targets",
    "select_targets",
    "tied_head",
    "untie_head",
    "weights_shared_across_layers",
]

#: Every ``nn.Linear`` (and subclass).
DEFAULT_TARGETS: tuple[str, ...] = ("Linear",)
#: The output head (tied to the input embedding in many LLMs).
DEFAULT_IGNORE: tuple[str, ...] = ("lm_head",)
#: llm-compressor's special targets; each matches every module (then only supported ones are selected).
ALL_MODULES: frozenset[str] = frozenset({"__ALL__", "__ALL_PRUNABLE__", "__ALL_QUANTIZABLE__"})

logger = logging.getLogger(__name__)

_SHOWN = 4  # module names quoted per message


def is_linear_like(module: nn.Module) -> bool:
    """Whether ``module`` holds a Linear-like weight: 2-D ``[out_features, in_features]`` applied to the last dim."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and getattr(module, "in_features", None) == weight.shape[1]
    )


def matches(name: str, module: nn.Module, pattern: str) -> bool:
    """Whether ``pattern`` matches the module called ``name`` itself (containers are not expanded here).

    Raises:
        re.error: ``pattern`` is ``"re:<regex>"`` with an invalid regex.
    """
    if pattern in ALL_MODULES:
        return True
    if isinstance(module, LinearView) or _is_conv1d(module):  # a Linear seen through a view: "Linear" names it
        if pattern == "Linear":
            return True
    names = [name, *(f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False))]
    if isinstance(module, LinearView):
        names.append(f"{name}.weight")
    if name.endswith(".base_layer"):  # peft's base layer: its weight also by the name of the layer around it
        outer = name.removesuffix(".base_layer")  # (q_proj.weight, as before the adapters and after merging them)
        names += [f"{outer}.{p}" for p, _ in module.named_parameters(recurse=False)]
    if pattern.startswith("re:"):
        regex = re.compile(pattern[3:])
        return any(regex.match(n) is not None for n in names)
    if pattern in names:
        return True
    return any(cls.__name__ == pattern for cls in type(module).__mro__ if issubclass(cls, nn.Module))


def match_precedence(name: str, module: nn.Module, patterns: Iterable[str]) -> list[str]:
    """The patterns of ``patterns`` that compressed-tensors matches against the module called ``name`` itself, in
    its order of precedence when a module matches the targets of several config groups
    (``compressed_tensors.utils.match.match_targets``, the first of which ``apply_quantization_config`` takes):
    the module's exact name, then ``re:`` patterns matching its name, then the names of its class or a base class
    (``"Linear"`` for a :class:`~llmc_fsm.toolkit.views.LinearView`); within each kind in string order (so of two
    ``re:`` patterns the one that sorts first comes first, whichever is narrower).

    Patterns that :func:`select_targets` follows but compressed-tensors does not match for quantization are left
    out: a parameter's name (``re:.*q_proj.weight``), a container (``LlamaMLP``), llm-compressor's ``__ALL__``.

    Raises:
        re.error: a ``"re:<regex>"`` pattern with an invalid regex.
    """
    given = sorted(dict.fromkeys(patterns))
    exact = [p for p in given if p == name]
    regex = [p for p in given if p.startswith("re:") and re.match(p[3:], name) is not None]
    names_class = [
        p
        for p in given
        if not p.startswith("re:")
        and p != name
        and (
            any(cls.__name__ == p for cls in type(module).__mro__ if issubclass(cls, nn.Module))
            or (p == "Linear" and (isinstance(module, LinearView) or _is_conv1d(module)))
        )
    ]
    return exact + regex + names_class


@attrs.frozen(kw_only=True)
class TargetSelection:
    """The modules a ``targets`` / ``ignore`` pair selects in one model (see :func:`select_targets`).

    Attributes:
        targets: the target patterns, as given.
        ignore: the ignore patterns, as given.
        selected: ``{full module name: module}`` to compress, in model order.
        selected_by: ``{full module name: the first target pattern that selected it}``.
        ignored: ``{full module name: reason}`` for every module a target selected
            but that is not compressed: the ``ignore`` pattern that excluded it
            (itself or a container around it), or ``"tied to <name>"`` when its
            weight is the same tensor as an ignored or already selected module's.
        unmatched_targets: ``{target pattern: why}`` for the patterns that selected
            no module with a supported weight (they match no module, or only
            containers/modules without such a weight).
        unmatched_ignore: the ignore patterns that match no module of the model
            at all (a typo, or a regex that cannot match a name).
    """

    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    selected: dict[str, nn.Module]
    selected_by: dict[str, str]
    ignored: dict[str, str]
    unmatched_targets: dict[str, str]
    unmatched_ignore: tuple[str, ...]

    def warnings(
        self, *, quiet_ignore: Iterable[str] = (), module_names: Iterable[str] = (), head: str | None = None
    ) -> list[str]:
        """One line per unmatched target and per unmatched ignore pattern (empty when all matched).

        Args:
            quiet_ignore: ignore patterns not to warn about when they match nothing
                (:func:`resolve_targets` passes the default ``lm_head``, not given by the user, on a model without a
                head of that name).
            module_names: the model's module names: an exact-name ignore pattern that matches nothing while modules
                end with it (``lm_head`` against a wrapper's ``model.lm_head``) names them.
            head: the full name of the model's output head (``get_output_embeddings()``), when it has one: an
                ``lm_head`` pattern that matches nothing names it (BioGPT's ``output_projection``) and says whether
                it is compressed (nothing is said when another ignore entry keeps that head dense).
        """
        quiet = set(quiet_ignore)
        names = list(module_names)
        lines = [f"target pattern {p!r} selects nothing: {why}" for p, why in self.unmatched_targets.items()]
        for p in self.unmatched_ignore:
            if p in quiet:
                continue
            ending = [n for n in names if n.endswith(f".{p}")] if not p.startswith("re:") else []
            if ending and all(n in self.ignored for n in ending):  # another entry ignores them (model_free_ptq
                continue  # adds the checkpoint's name of lm_head: "so ... is compressed" was false, found by a tester)
            ending = [n for n in ending if n not in self.ignored]
            if not ending and head is not None and "lm_head" in p and (head in self.ignored or head in self.ignore):
                continue  # another entry keeps the head dense (ignore: [lm_head, head] on RWKV: found by a tester)
            if not ending and head is not None and "lm_head" in p:
                fate = "so it is compressed" if head in self.selected else "which the targets do not compress"
                lines.append(
                    f"ignore pattern {p!r} matches no module: this model's output head is {head!r}, {fate}; "
                    f"give ignore: [{head}] to keep it dense"
                )
            elif ending:
                lines.append(
                    f"ignore pattern {p!r} matches no module, so {_shown(ending)} is compressed: names are full "
                    f"module names; 're:.*{re.escape(p)}$' would match it"
                )
            else:
                lines.append(
                    f"ignore pattern {p!r} matches no module (check the spelling; 're:' patterns use re.match on "
                    "full module names, e.g. 're:.*lm_head')"
                )
        return lines


def _check_patterns(patterns: Iterable[str], what: str) -> tuple[str, ...]:
    if isinstance(patterns, str):
        patterns = [patterns]
    result = tuple(patterns)
    for pattern in result:
        if not isinstance(pattern, str):
            msg = f"{what} patterns must be strings (class name, full name or 're:<regex>'), got {pattern!r}"
            raise ValueError(msg)
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as exc:
                msg = f"invalid regex in {what} pattern {pattern!r}: {exc}"
                raise ValueError(msg) from None
    return result


def _parent(name: str) -> str | None:
    if not name:
        return None
    return name.rsplit(".", 1)[0] if "." in name else ""


def _ancestors(name: str) -> Iterable[str]:
    """The names above ``name``, nearest first, down to ``""`` (a view's parent need not be a module)."""
    parent = _parent(name)
    while parent is not None:
        yield parent
        parent = _parent(parent)


def _through_parameters(name: str, module: nn.Module, pattern: str) -> set[str] | None:
    """For a fused mixture-of-experts module that ``pattern`` matches only through the names of its fused parameters
    (``re:.*\\.down_proj$`` against ``mlp.experts.down_proj``): those parameters' names, whose expert views the
    pattern selects (not the module's other matrices); ``None`` otherwise (the pattern names the module itself, by
    name or class, or the module has no expert views)."""
    if not matches(name, module, pattern):
        return None
    views = weight_views(module)
    if not views or "" in views:
        return None
    if pattern in ALL_MODULES or any(cls.__name__ == pattern for cls in type(module).__mro__):
        return None
    regex = re.compile(pattern[3:]) if pattern.startswith("re:") else None
    if (regex.match(name) is not None) if regex is not None else pattern == name:
        return None
    full = {p: f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)}
    return {p for p, n in full.items() if (regex.match(n) is not None if regex is not None else pattern == n)}


def _first_match(named: list[tuple[str, nn.Module]], patterns: tuple[str, ...]) -> dict[str, str | None]:
    """Per module name: the first pattern matching it, else its nearest container's, else ``None``. A fused experts
    module matched through a parameter's name passes the pattern on to that parameter's views only."""
    found: dict[str, str | None] = {}
    partial: dict[str, dict[str, set[str]]] = {}  # module -> pattern -> parameters it matched through
    for name, module in named:
        own = None
        for p in patterns:
            params = _through_parameters(name, module, p)
            if params is not None:
                partial.setdefault(name, {})[p] = params
            elif matches(name, module, p):
                own = p
                break
        parent = next((a for a in _ancestors(name) if a in found), None)
        if own is None and parent in partial and isinstance(module, LinearView):
            own = next((p for p, params in partial[parent].items() if module.param_name in params), None)
        found[name] = own or (found[parent] if parent is not None else None)
    return found


def _patterns_selecting(named, supported_names: set[str], targets: tuple[str, ...]) -> dict[str, set[str]]:
    """target pattern -> supported module names it selects (directly or through a container; a fused experts module
    matched through a parameter's name: that parameter's views only)."""
    result: dict[str, set[str]] = {p: set() for p in targets}
    names = {name for name, _ in named}
    for pattern in targets:
        hit: set[str] = set()
        partial: dict[str, set[str]] = {}
        for name, module in named:
            parent = next((a for a in _ancestors(name) if a in names), None)
            if parent is not None and parent in partial:
                if isinstance(module, LinearView) and module.param_name in partial[parent]:
                    hit.add(name)
                continue
            params = _through_parameters(name, module, pattern)
            if params is not None:
                partial[name] = params
            elif (parent is not None and parent in hit) or matches(name, module, pattern):
                hit.add(name)
        result[pattern] = hit & supported_names
    return result


def _shown(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def compact_names(names: Iterable[str]) -> str:
    """Module names folded over their layer index, for one-line messages.

    ``model.layers.0.mlp.up_proj`` ... ``model.layers.29.mlp.up_proj`` becomes
    ``model.layers.{0..29}.mlp.up_proj``; names whose only difference is one
    integer component are folded (consecutive indices as a range, others
    listed), every other name is kept as it is. Order: first appearance.
    """
    groups: dict[tuple[str, str | None], list[int]] = {}
    for name in names:
        parts = name.split(".")
        idx = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if idx is None:
            groups.setdefault((name, None), [])
            continue
        key = (".".join(parts[:idx]), ".".join(parts[idx + 1 :]))
        groups.setdefault(key, []).append(int(parts[idx]))
    shown = []
    for (head, tail), indices in groups.items():
        if tail is None:
            shown.append(head)
            continue
        indices = sorted(set(indices))
        if len(indices) == 1:
            index = str(indices[0])
        elif indices == list(range(indices[0], indices[-1] + 1)):
            index = f"{{{indices[0]}..{indices[-1]}}}"
        else:
            index = "{" + ",".join(map(str, indices)) + "}"
        shown.append(".".join(p for p in (head, index, tail) if p))
    return ", ".join(shown)


def _unmatched_reason(named, pattern: str, adapters: set[str]) -> str:
    direct = [f"{n or '<model>'} ({type(m).__name__})" for n, m in named if matches(n, m, pattern)]
    if not direct:
        return "it matches no module"
    if all(n in adapters for n, m in named if matches(n, m, pattern)):
        return (
            "it matches only peft adapter layers (LoRA's A / B and the layers around a base_layer), which are never "
            f"compressed: {_shown(direct)}; the base layers are (e.g. 're:.*base_layer$')"
        )
    return f"it matches only modules that are not Linear-like (no 2-D weight with in_features): {_shown(direct)}"


def _nothing_selected(
    model: nn.Module, targets: tuple[str, ...], unmatched: dict[str, str], supported_names: list[str]
) -> ValueError:
    reasons = "; ".join(f"{p!r}: {why}" for p, why in unmatched.items())
    msg = (
        f"targets {list(targets)} select no module with a Linear-like weight in {type(model).__name__} "
        f"({reasons}). Patterns are class names ('Linear'), full module names or 're:<regex>' (re.match on "
        f"full names). Linear-like modules: {_shown(supported_names) or 'none'}"
    )
    return ValueError(msg)


def is_peft_tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is one of peft's tuner layers (a LoRA ``Linear``...: duck-typed on peft's
    ``BaseTunerLayer``, a ``base_layer`` module and its ``adapter_layer_names``; peft is not imported)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and bool(
        getattr(module, "adapter_layer_names", None)
    )


def _peft_adapters(named: Iterable[tuple[str, nn.Module]]) -> set[str]:
    """The names of peft's tuner layers (a LoRA ``Linear`` around its ``base_layer``, duck-typed on peft's
    ``BaseTunerLayer``: a ``base_layer`` module and ``adapter_layer_names``) and of the adapter modules under them
    (``lora_A``, ``lora_B``, ...). They are never selected: the weight a pruning or quantization modifier compresses
    is the base layer's (the tuner layer's ``weight`` is that same tensor), and the adapters are what training
    changes (a mask on LoRA's zero-initialised B froze it: found by a tester)."""
    named = list(named)
    wrappers: set[str] = set()
    adapters: set[str] = set()
    for name, module in named:
        if name and is_peft_tuner_layer(module):
            wrappers.add(name)
            adapters.update(f"{name}.{a}" for a in module.adapter_layer_names)
    under = tuple(f"{a}." for a in adapters)
    return wrappers | {n for n, _ in named if n in adapters or n.startswith(under)}


def _is_conv1d(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and type(module).__name__ == "Conv1D"


def _is_fused_experts(module: nn.Module) -> bool:
    """A mixture-of-experts module holding its experts' weights itself (transformers 5's fused 3-D ``gate_up_proj`` /
    ``down_proj``, DBRX's 2-D ``w1`` / ``v1`` / ``w2``), not as one ``nn.Linear`` per expert."""
    return "expert" in type(module).__name__.lower() and any(p.dim() >= 2 for p in module.parameters(recurse=False))


def _selected_unsupported(
    named,
    targets: tuple[str, ...],
    ignore: tuple[str, ...],
    kind: Callable[[nn.Module], bool],
    linear_alias: str | None,
) -> list[str]:
    """Modules of ``kind`` the targets select (directly or through a container; ``"Linear"`` also counts as
    naming ``linear_alias`` or, when ``None``, every such module) and ``ignore`` does not exclude."""
    found = {name for name, module in named if kind(module)}
    if not found:
        return []
    patterns = targets
    if "Linear" in targets:
        patterns = targets + ((linear_alias,) if linear_alias else ("__ALL__",))
    hit = set().union(*_patterns_selecting(named, found, patterns).values())
    ignored_by = _first_match(named, ignore)
    return [name for name, _ in named if name in hit and ignored_by[name] is None]


def model_family(model: nn.Module) -> str:
    """``model``'s class and ``model_type`` for messages, e.g. ``"Qwen3MoeForCausalLM (model_type 'qwen3_moe')"``
    (the class name alone when its config has no ``model_type``)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} (model_type {model_type!r})" if model_type else type(model).__name__


def _experts_error(model: nn.Module, targets: tuple[str, ...], names: list[str], named, *, views: bool) -> ValueError:
    modules = dict(named)
    weights = sorted({p for n in names for p, t in modules[n].named_parameters(recurse=False) if t.dim() >= 2})
    head = (
        f"{model_family(model)} keeps its experts fused in {compact_names(names)} ({', '.join(weights)}: every "
        f"expert's weights in one tensor, not one Linear per expert), which targets {list(targets)} select; "
    )
    if views:
        reasons = sorted({fused_experts_reason(modules[n]) or f"layout of {type(modules[n]).__name__}" for n in names})
        tail = (
            f"no per-expert view of this layout ({'; '.join(reasons)}): add 're:.*\\.experts' to ignore to "
            "compress the other modules (the report then counts only those)"
        )
    else:
        tail = (
            "this modifier compresses Linear modules only (SparseGPT, Wanda, magnitude, GPTQ, QuantizationModifier "
            "and AutoRound compress fused experts per expert): add 're:.*\\.experts' to ignore to compress the "
            "other modules"
        )
    return ValueError(head + tail)


def _conv1d_error(model: nn.Module, targets: tuple[str, ...], names: list[str]) -> ValueError:
    msg = (
        f"{model_family(model)} keeps {compact_names(names)} as transformers Conv1D (a Linear whose weight is stored "
        f"[in, out]), which targets {list(targets)} select; this modifier compresses Linear modules only: the "
        "pruning modifiers (SparseGPT, Wanda, magnitude) prune Conv1D; quantizing it is not implemented (the "
        "quantizers quantize and save nn.Linear modules, compressed-tensors' layout): add them to ignore to "
        "compress only the other modules"
    )
    return ValueError(msg)


def _head_name(model: nn.Module) -> str | None:
    """The full module name of ``model``'s output head (``get_output_embeddings()``), ``None`` without one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return None
    return next((name for name, module in model.named_modules() if module is head and name), None)


def tied_head(model: nn.Module) -> nn.Module | None:
    """``model``'s output head (``get_output_embeddings()``) when its weight is its input embedding's, else ``None``."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not callable(get_in) or not callable(get_out):
        return None
    embedding, head = get_in(), get_out()
    weight = getattr(head, "weight", None)
    return head if weight is not None and weight is getattr(embedding, "weight", None) else None


def untie_head(model: nn.Module) -> bool:
    """Give ``model``'s head (tied to its input embedding, :func:`tied_head`) a weight of its own, a copy of the same
    values, and set ``config.tie_word_embeddings = False`` (so it is saved and reloaded apart), as llm-compressor's
    ``untie_word_embeddings`` does before it quantizes a tied head; the embedding is not changed. Returns whether
    the head was tied."""
    head = tied_head(model)
    if head is None:
        return False
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    for config in (getattr(model, "config", None), getattr(getattr(model, "config", None), "text_config", None)):
        if config is not None and getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
    return True


def _tied_error(name: str, other: str, other_module: nn.Module) -> ValueError:
    kind = "tied embeddings" if isinstance(other_module, nn.Embedding) else "tied weights"
    msg = (
        f"{name} shares its weight with {other} ({kind}); compressing it changes {other} too. Untie first "
        f"(model.config.tie_word_embeddings=False and clone the weight) or add {name} to ignore"
    )
    return ValueError(msg)


def offloaded_to(model: nn.Module) -> str | None:
    """Where compressed-tensors offloads ``model``'s weights when its onloading copies them (disk, or a device other
    than the one it onloads to: its ``OffloadCache`` then gives a new tensor at each access, and a weight compressed
    in place is lost), else ``None`` (CPU onloaded to CPU gives the stored tensor itself). Found by a tester: a
    disk-offloaded Qwen3 was refused as having tied weights (the onloaded copies' ids were reused once freed)."""
    for module in model.modules():
        cache = module._parameters
        offload, onload = getattr(cache, "offload_device", None), getattr(cache, "onload_device", None)
        if (
            offload is not None
            and onload is not None
            and (offload == "disk" or torch.device(offload) != torch.device(onload))
        ):
            return str(offload)
    return None


OFFLOAD_REFUSAL = (
    "the model is offloaded by compressed-tensors to {where} (load_offloaded_model, device_map='auto_offload', "
    "llm-compressor's load_context): each access to a weight reads a new copy, so weights compressed in place would "
    "be lost; give its directory instead with low_memory=True (model=DIR: streamed one decoder layer at a time; "
    "--model DIR --low-memory)"
)


def llmcompressor_module(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The first module of ``model`` (in ``named_modules`` order: the outermost) whose class llm-compressor defines
    (its ``__module__`` under ``llmcompressor.``), with its name; ``None`` when there is none. llm-compressor's
    ``load_context`` / ``load_quantizable_moe`` / ``linearize_moe`` put its ``LinearExperts2D`` (one
    ``ExpertMLPWithGate`` of Linears per expert) in place of a mixture-of-experts layer's fused experts; a checkpoint
    of those modules holds ``experts.<e>.gate_proj.weight``..., which transformers does not reload into its fused
    ``gate_up_proj`` / ``down_proj`` (left random; found by a tester: Qwen3-MoE's logits moved by 0.09)."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith("llmcompressor."):
            return name, module
    return None


#: The refusal of a model holding a module of llm-compressor's (:func:`llmcompressor_module`): ``name``, ``cls``
#: (its class name) and ``where`` (its class's module) to format.
LLMCOMPRESSOR_MODULE_REFUSAL = (
    "{name} is llm-compressor's {cls} ({where}), which its load_context / linearize_moe put in place of the "
    "model's own module (one Linear per expert for fused experts): transformers reloads only its own layout, so "
    "a checkpoint of it would reload with those weights missing; load the model with "
    "AutoModelForCausalLM.from_pretrained directly, without load_context (to bound the memory, give its directory "
    "with low_memory=True instead: model=DIR; --model DIR --low-memory)"
)


def refuse_llmcompressor_modules(model: nn.Module) -> None:
    """Refuse ``model`` when it holds a module of llm-compressor's (:func:`llmcompressor_module`).

    Raises:
        ValueError: :data:`LLMCOMPRESSOR_MODULE_REFUSAL`, naming the outermost such module and its class.
    """
    found = llmcompressor_module(model)
    if found is not None:
        name, module = found
        cls = type(module)
        raise ValueError(LLMCOMPRESSOR_MODULE_REFUSAL.format(name=name, cls=cls.__name__, where=cls.__module__))


def _apply_ties(
    named, candidates: dict[str, nn.Module], ignored_names: set[str], *, head: nn.Module | None = None
) -> tuple[dict, dict]:
    """Split ``candidates`` into selected and ``{name: "tied to X"}``; raise for a weight shared with the rest,
    except ``head`` (the output head, :func:`tied_head`), selected: its modifier unties it before compressing it
    (with the input embedding when both are candidates, each then compressed on its own)."""
    holders: dict[int, list[str]] = {}
    modules = dict(named)
    for name, module in named:
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(name)
    selected: dict[str, nn.Module] = {}
    tied: dict[str, str] = {}
    for name, module in candidates.items():
        weight = getattr(module, "weight", None)
        others = [n for n in holders.get(id(weight), []) if n != name] if weight is not None else []
        ignored_partner = next((n for n in others if n in ignored_names), None)
        earlier = next((n for n in others if n in selected), None)
        if earlier is not None and head is not None and head in (module, modules[earlier]):
            earlier = None  # the head and the embedding both selected: the head is untied first, each compressed
        if ignored_partner is not None or earlier is not None:
            tied[name] = f"tied to {ignored_partner if ignored_partner is not None else earlier}"
            continue
        outside = next((n for n in others if n not in candidates), None)
        if outside is not None and module is not head:
            raise _tied_error(name, outside, modules[outside])
        selected[name] = module
    return selected, tied


def select_targets(
    model: nn.Module,
    targets: Iterable[str] = DEFAULT_TARGETS,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    *,
    supported: Callable[[nn.Module], bool] = is_linear_like,
    views: bool = False,
    untie_head: bool = False,
) -> TargetSelection:
    """Select the modules of ``model`` that ``targets`` name and ``ignore`` does not (see the module docs).

    Pure: nothing is logged and the model is not changed. :func:`resolve_targets`
    is the thin wrapper modifiers call; it also logs :meth:`TargetSelection.warnings`.

    Args:
        model: any ``nn.Module``; names are those of ``model.named_modules()``.
        targets: patterns of the modules to compress (a string is one pattern).
        ignore: patterns of modules never compressed; a module whose weight is the
            same tensor as an ignored module's is ignored too ("tied to ...").
        supported: which modules may be selected (default :func:`is_linear_like`).
        views: also select the :class:`~llmc_fsm.toolkit.views.LinearView` of weights kept otherwise
            (:func:`~llmc_fsm.toolkit.views.weight_views`): each expert matrix of a fused mixture-of-experts module
            (``<experts>.<e>.gate_proj`` ...; a target or ignore pattern that matches the experts module or a
            container matches its views, ``"Linear"`` matches every view) and each ``Conv1D`` (selected under its
            own name, as its transposed view). The routers of those mixture-of-experts layers
            (:func:`~llmc_fsm.toolkit.views.router_names`) are then ignored (``"router of a mixture-of-experts
            layer"``) unless a target names one exactly. For modifiers that write ``module.weight`` in place
            (pruning); ``False`` (quantizers) refuses them as below.
        untie_head: select the output head (``get_output_embeddings()``) also when its weight is tied to the input
            embedding, which is not selected (quantizers: they untie it first, :func:`untie_head`, as llm-compressor
            does); otherwise that is refused as below.

    Returns:
        a :class:`TargetSelection`.

    Raises:
        ValueError: a pattern that is not a string or not a valid regex; no target
            selects any supported module (the message says why for each pattern and
            lists the Linear-like modules); every selected module is ignored; or a selected
            module's weight is shared with a module that is neither selected nor
            ignored, e.g. ``lm_head`` tied to ``model.embed_tokens`` (compressing it
            would silently change the embedding too).
            Also, without ``views``: a target selects a ``transformers`` ``Conv1D`` (GPT-2 family) that
            ``ignore`` does not exclude (``"Linear"`` counts as naming it); the message
            names the model family and the modules. Likewise a mixture-of-experts module
            holding its experts fused (transformers 5's 3-D ``gate_up_proj``, DBRX's
            ``w1``). With ``views``: such a module whose layout has no view (e.g. Llama 4's experts).
            Also a model offloaded by compressed-tensors (:data:`OFFLOAD_REFUSAL`), and one holding a module of
            llm-compressor's, e.g. the per-expert Linears of its ``load_context``
            (:data:`LLMCOMPRESSOR_MODULE_REFUSAL`).
    """
    targets = _check_patterns(targets, "target")
    ignore = _check_patterns(ignore, "ignore")
    if not targets:
        msg = "targets is empty: give at least one module pattern, e.g. ['Linear']"
        raise ValueError(msg)
    named = list(model.named_modules())
    if views:
        named, substitute, covered = _with_views(named)
        check = supported

        def supported(module: nn.Module) -> bool:
            return isinstance(module, LinearView) or _is_conv1d(module) or check(module)

        experts = [
            n
            for n in _selected_unsupported(named, targets, ignore, _is_fused_experts, None)
            if id(dict(named)[n]) not in covered
        ]
    else:
        substitute = {}
        conv1d = _selected_unsupported(named, targets, ignore, _is_conv1d, "Conv1D")
        if conv1d:
            raise _conv1d_error(model, targets, conv1d)
        experts = _selected_unsupported(named, targets, ignore, _is_fused_experts, None)
    if experts:
        raise _experts_error(model, targets, experts, named, views=views)
    adapters = _peft_adapters(named)
    supported_names = {name for name, module in named if supported(module) and name not in adapters}
    by_pattern = _patterns_selecting(named, supported_names, targets)
    unmatched = {p: _unmatched_reason(named, p, adapters) for p, hit in by_pattern.items() if not hit}
    if len(unmatched) == len(targets):
        raise _nothing_selected(model, targets, unmatched, [n for n, _ in named if n in supported_names])
    ignored_by = _first_match(named, ignore)
    if views:
        for name in router_names(named):
            if ignored_by.get(name) is None and name not in targets:
                ignored_by[name] = "router of a mixture-of-experts layer"
    ignored_names = {n for n, p in ignored_by.items() if p is not None}
    target_names = set().union(*by_pattern.values())
    candidates: dict[str, nn.Module] = {}
    selected_by: dict[str, str] = {}
    ignored: dict[str, str] = {}
    for name, module in named:
        if name not in target_names:
            continue
        selected_by[name] = next(p for p in targets if name in by_pattern[p])
        pattern = ignored_by[name]
        if pattern is not None:
            ignored[name] = pattern
        else:
            candidates[name] = substitute.get(name, module)
    if (where := offloaded_to(model)) is not None:
        raise ValueError(OFFLOAD_REFUSAL.format(where=where))
    refuse_llmcompressor_modules(model)
    selected, tied = _apply_ties(named, candidates, ignored_names, head=tied_head(model) if untie_head else None)
    ignored.update(tied)
    if not selected:
        msg = (
            f"every module selected by targets {list(targets)} is excluded by ignore {list(ignore)} "
            f"(or tied to an ignored weight): {_shown(list(ignored))}"
        )
        raise ValueError(msg)
    return TargetSelection(
        targets=targets,
        ignore=ignore,
        selected=selected,
        selected_by={n: selected_by[n] for n in selected},
        ignored=ignored,
        unmatched_targets=unmatched,
        unmatched_ignore=tuple(p for p in ignore if not any(matches(n, m, p) for n, m in named)),
    )


def _with_views(named: list[tuple[str, nn.Module]]) -> tuple[list, dict[str, LinearView], set[int]]:
    """``named`` with each fused-experts module followed by its views, Conv1D's view by name, covered owners."""
    expanded: list[tuple[str, nn.Module]] = []
    substitute: dict[str, LinearView] = {}
    covered: set[int] = set()
    for name, module in named:
        expanded.append((name, module))
        found = weight_views(module)
        for suffix, view in found.items():
            covered.add(id(view.owner))
            if suffix:
                expanded.append((f"{name}.{suffix}" if name else suffix, view))
            else:
                substitute[name] = view
    return expanded, substitute, covered


def resolve_targets(
    model: nn.Module,
    targets: Iterable[str] = DEFAULT_TARGETS,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    *,
    warned: set[str] | None = None,
    supported: Callable[[nn.Module], bool] = is_linear_like,
    views: bool = False,
    untie_head: bool = False,
    ignore_given: bool | None = None,
) -> dict[str, nn.Module]:
    """Return ``{full name: module}`` to compress, in model order: :attr:`select_targets(...).selected`.

    Logs a warning (logger ``llmc_fsm.toolkit.targets``) for each target pattern that
    selects nothing while others do, and for each ``ignore`` pattern that matches
    no module -- except the default ``lm_head``, not given by the user, on a model without a module of that name (a
    wrapper's ``model.lm_head`` is warned about: it is compressed). A user-given ``lm_head`` that matches nothing is
    warned about with the name of the model's output head (``get_output_embeddings()``, e.g. BioGPT's
    ``output_projection``) and whether it is compressed. ``warned``:
    the warnings already given (by an earlier call for the same modifier); not repeated, new ones added.
    ``supported``: which modules may be selected; ``views``: whether the Linear views of fused experts and Conv1D
    are selectable, ``untie_head`` whether a head tied to the input embedding is (as for :func:`select_targets`).
    ``ignore_given``: whether the user gave ``ignore`` (``False``: it is the caller's default); ``None``, for a
    caller that does not know: given unless it equals :data:`DEFAULT_IGNORE` (until 2026-12-07 an ``lm_head`` was
    never warned about on a model without one, so an explicit ``ignore: [lm_head]`` left BioGPT's head quantized
    without a word: found by a tester).

    Raises:
        ValueError: as :func:`select_targets`.
    """
    selection = select_targets(model, targets, ignore, supported=supported, views=views, untie_head=untie_head)
    names = [name for name, _ in model.named_modules()]
    heads = [n for n in names if n.rsplit(".", 1)[-1] in DEFAULT_IGNORE]  # a wrapper's model.lm_head: not quiet
    if ignore_given is None:
        ignore_given = list(selection.ignore) != list(DEFAULT_IGNORE)
    quiet = () if heads or ignore_given else DEFAULT_IGNORE
    for line in selection.warnings(quiet_ignore=quiet, module_names=names, head=_head_name(model)):
        if warned is None or line not in warned:
            logger.warning("%s", line)
        if warned is not None:
            warned.add(line)
    return selection.selected


#: The keys of a model's config (``config.json``) that say its checkpoint is quantized: transformers'
#: ``quantization_config``, and the ``compression_config`` that older compressed-tensors versions wrote.
QUANTIZED_CONFIG_KEYS = ("quantization_config", "compression_config")


def config_quantization(config: Any) -> tuple[str, Any] | None:
    """``(key, value)`` of the first of :data:`QUANTIZED_CONFIG_KEYS` that ``config`` carries (not ``None``), else
    ``None``. ``config``: a transformers config (attributes), a ``config.json`` mapping, or ``None``."""
    for key in QUANTIZED_CONFIG_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value is not None:
            return key, value
    return None


def check_not_quantized(model: nn.Module, owner: str, hint: str) -> None:
    """Refuse a model whose config says it is quantized (a ``quantization_config`` or an older
    ``compression_config``, :func:`config_quantization`), before any work.

    Modules quantized in memory (an earlier stage of the same run) are checked per modifier, on its own targets
    (:meth:`llmc_fsm.toolkit.calibrated.CalibratedModifier.check_model`). One-shot runs the same check on a model
    directory's ``config.json`` before its weights are read (:func:`llmc_fsm.oneshot_job.phases.prepare`).

    Args:
        model: the model to compress (any device, ``meta`` included; only its config is read).
        owner: who refuses, the message's first word (a modifier's class name).
        hint: what to do instead, the message's last clause.

    Raises:
        ValueError: ``"<owner>: the model is already quantized (<why>); <hint>"``; ``why`` names the config key and
            its ``quant_method`` (when it has one), and for a KV-cache-only config (``kv_cache_scheme`` without
            weight groups) says that its KV-cache scales would be lost.
    """
    found = config_quantization(getattr(model, "config", None))
    if found is None:
        return
    key, config_q = found
    method = config_q.get("quant_method") if isinstance(config_q, dict) else getattr(config_q, "quant_method", None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    inner = config_q.get("quantization_config", config_q) if isinstance(config_q, dict) else config_q
    inner = getattr(inner, "quantization_config", None) or inner  # transformers' CompressedTensorsConfig wraps it
    get = inner.get if isinstance(inner, dict) else lambda name: getattr(inner, name, None)
    why = f"its config carries a {key}" + ("" if method is None else f" (quant_method {method!r})")
    if get("kv_cache_scheme") is not None and not get("config_groups"):  # KV-cache scales only, weights as loaded
        why += (
            " with a kv_cache_scheme and no weight scheme: its KV-cache scales, which transformers does not load, "
            "would be lost; put the kv_cache_scheme in the recipe that compresses the full-precision model"
        )
    raise ValueError(f"{owner}: the model is already quantized ({why}); {hint}")


def weights_shared_across_layers(layers: nn.ModuleList) -> list[tuple[str, ...]]:
    """The parameters that several decoder layers hold (one tensor under names in different layers: Zamba's shared
    transformer block, whose weights each hybrid layer's own modules hold), each as its names relative to
    ``layers`` (``("1.shared_transformer.self_attn.q_proj.weight", "3.shared_transformer...")``), in order; ``[]``
    when no layer shares a weight with another. Works on ``meta`` (reads no value)."""
    names: dict[int, list[str]] = {}
    for name, parameter in layers.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [tuple(found) for found in names.values() if len({n.split(".", 1)[0] for n in found}) > 1]
