"""Linear views of weights that are not kept as one ``nn.Linear`` each: fused mixture-of-experts weights, ``Conv1D``.

transformers 5 keeps a mixture-of-experts layer's experts in one module holding every expert's weights in one
tensor (``gate_up_proj`` ``[experts, 2 * intermediate, hidden]``, ``down_proj`` ``[experts, hidden, intermediate]``
in ``MixtralExperts``, ``Qwen3MoeExperts`` and the ~60 classes built with transformers'
``use_experts_implementation``; DBRX keeps ``w1`` / ``v1`` / ``w2`` as 2-D ``[experts * ffn, hidden]``), and GPT-2
keeps its projections as ``transformers.Conv1D``, a Linear whose weight is stored ``[in_features, out_features]``.
A :class:`LinearView` is one such matrix seen as a Linear weight ``[out_features, in_features]``: its ``weight`` is a
view sharing the parameter's storage (so a modifier that writes ``view.weight.copy_(new)`` writes the model's own
parameter, and the model saves in its own fused layout), and calling it records an input (its ``forward`` returns
the input unchanged: it is an observation point for forward pre-hooks, never part of the model's computation).

:func:`weight_views` gives the views of one module (cached on it, so the same objects come back); the views are not
registered as submodules, so the model's ``state_dict``, ``named_modules`` and saved checkpoint are unchanged.
:func:`observe_inputs` feeds the views of a module the inputs each matrix receives in the module's forward: for
experts, each expert's own routed tokens (``all_experts=True``: every token, for statistics only), computed from the
module's own inputs; the module's output is computed by its own forward, untouched.

Per expert, a gated layer's ``gate_up_proj`` is split into its gate rows and up rows (``is_concatenated``: the first
and second halves; otherwise interleaved, even and odd rows, as GPT-OSS), named ``<experts>.<e>.gate_proj`` /
``up_proj`` / ``down_proj`` -- the names transformers 4 gave the per-expert Linears, so recipes written for them
still match; DBRX's are ``<experts>.mlp.<e>.w1`` / ``v1`` / ``w2``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import re
import weakref
from collections.abc import Callable, Container, Mapping
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "ExpertsLayout",
    "LinearView",
    "clear_weight_views",
    "expert_checkpoint_names",
    "experts_layout",
    "fused_experts_reason",
    "linear_expert_names",
    "observe_inputs",
    "observe_view_inputs",
    "quantize_expert_inputs",
    "reloads_as_linears",
    "router_names",
    "weight_views",
]

#: ``{module: {name suffix: LinearView}}``, off the modules: cached on the module (``_llmc_fsm_weight_views``) it was
#: left on every module after a run and ``torch.save(model)`` pickled llmc-fsm's classes, so loading needed
#: llmc-fsm (found by a tester). The views hold their modules weakly, so an entry goes with its module.
_VIEWS: weakref.WeakKeyDictionary[nn.Module, dict[str, LinearView]] = weakref.WeakKeyDictionary()
logger = logging.getLogger(__name__)


class LinearView(nn.Module):
    """One matrix of another module's parameter, seen as a Linear weight ``[out_features, in_features]``.

    Not a submodule of anything (no parameter, no buffer, not saved). ``weight`` reads the owner's parameter each
    time (a view: same storage; onloading that replaces the parameter is followed). Calling the view returns its
    input unchanged, after its forward pre-hooks saw it (see :func:`observe_inputs`).

    Attributes:
        owner: the module holding the parameter (held weakly: the view keeps no module alive; ``ReferenceError``
            once that module is gone).
        source: the module :func:`weight_views` gave it for, whose call :func:`observe_inputs` observes (the
            owner, except DBRX: ``DbrxExperts`` routes, its ``mlp`` holds the weights); held weakly too.
        param_name: the parameter's name on ``owner``.
        expert: the expert index, or ``None`` (Conv1D).
        in_features / out_features: the matrix as a Linear (ints).
        transposed / rows / block: how the matrix is read: ``param[expert]`` (or, with ``block``, rows
            ``expert * block ... (expert + 1) * block`` of a 2-D ``param``: DBRX), transposed, then ``rows`` of it.
        routed_tokens: tokens the router sent to this expert in the calls :func:`observe_inputs` observed (``0``
            before, always ``0`` for Conv1D): while a modifier's hooks are on, that includes the pipeline's pass that
            propagates the compressed layer (the plain order); the modifiers' ``routed_tokens`` and the report's,
            copied when the matrix is compressed, count the calibration tokens only.
    """

    def __init__(
        self,
        owner: nn.Module,
        param_name: str,
        *,
        expert: int | None,
        in_features: int,
        out_features: int,
        transposed: bool = False,
        rows: slice | None = None,
        block: int | None = None,
    ) -> None:
        super().__init__()
        self.__dict__["_owner"] = weakref.ref(owner)  # not registered: the view is no part of the owner's tree
        self.__dict__["_source"] = self.__dict__["_owner"]
        self.param_name = param_name
        self.expert = expert
        self.transposed = transposed
        self.rows = rows
        self.block = block
        self.in_features = in_features
        self.out_features = out_features
        self.routed_tokens = 0

    @property
    def owner(self) -> nn.Module:
        """The module holding the parameter."""
        return _alive(self.__dict__["_owner"])

    @property
    def source(self) -> nn.Module:
        """The module whose call :func:`observe_inputs` observes for this view."""
        return _alive(self.__dict__["_source"])

    @property
    def weight(self) -> torch.Tensor:
        """``[out_features, in_features]`` view of the owner's parameter (shares its storage)."""
        return self.matrix_of(getattr(self.owner, self.param_name))

    def matrix_of(self, p: torch.Tensor) -> torch.Tensor:
        """This view's matrix read from ``p``, a tensor laid out like the owner's parameter (same leading sizes)."""
        if self.expert is not None:
            p = p.view(-1, self.block, p.shape[-1])[self.expert] if self.block is not None else p[self.expert]
        w = p.T if self.transposed else p
        return w if self.rows is None else w[self.rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` unchanged (an observation point: forward pre-hooks see the matrix's input)."""
        return x

    def extra_repr(self) -> str:
        return (
            f"{type(self.owner).__name__}.{self.param_name}, expert={self.expert}, "
            f"in_features={self.in_features}, out_features={self.out_features}"
        )


def _alive(ref: weakref.ref[nn.Module]) -> nn.Module:
    module = ref()
    if module is None:
        msg = "the module this weight view reads was deleted: get the views of a live module again (weight_views)"
        raise ReferenceError(msg)
    return module


def _is_conv1d(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2


def _is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts class built with ``use_experts_implementation`` (its layout flags set at init)."""
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated")) and hasattr(
        module, "num_experts"
    )


def _is_llama4(module: nn.Module) -> bool:
    """Llama 4's ``Llama4TextExperts`` (no layout flags): ``gate_up_proj`` ``[experts, hidden, 2 * expert_dim]`` and
    ``down_proj`` ``[experts, expert_dim, hidden]``, stored ``[in, out]`` (transposed), gate columns then up columns
    (``act(gate) * up``, no biases). Its forward takes ``[experts * tokens, hidden]``: every token once per expert,
    already multiplied by that expert's router score (zero where the router did not choose the expert)."""
    return (
        type(module).__name__ == "Llama4TextExperts"
        and all(isinstance(getattr(module, p, None), torch.Tensor) for p in ("gate_up_proj", "down_proj"))
        and hasattr(module, "num_experts")
        and hasattr(module, "act_fn")
    )


class ExpertsLayout(NamedTuple):
    """How fused experts keep their matrices, in transformers' layout flags (:func:`experts_layout`).

    Attributes:
        first: the parameter of the input projections, ``"gate_up_proj"`` (gated) or ``"up_proj"``.
        has_gate: gate rows beside the up rows, combined as ``act(gate) * up``.
        has_bias: ``<first>_bias`` and ``down_proj_bias`` parameters.
        is_transposed: matrices stored ``[in, out]`` (``[experts, hidden, 2 * inter]``), not ``[out, in]``.
        is_concatenated: the gate rows are the first half and the up rows the second (else interleaved).
    """

    first: str
    has_gate: bool
    has_bias: bool
    is_transposed: bool
    is_concatenated: bool


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout of fused experts ``module``: read from a transformers ``use_experts_implementation`` class's flags
    (``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``), Llama 4's ``Llama4TextExperts``'
    (transposed, gate then up columns, no bias: fixed by its forward), or ``None`` for any other module."""
    if _is_hf_experts(module):
        first = "gate_up_proj" if module.has_gate else "up_proj"
        flags = (module.has_gate, module.has_bias, module.is_transposed, module.is_concatenated)
        return ExpertsLayout(first, *(bool(f) for f in flags))
    if _is_llama4(module):
        return ExpertsLayout("gate_up_proj", True, False, True, True)
    return None


def _is_dbrx(module: nn.Module) -> bool:
    mlp = getattr(module, "mlp", None)
    return (
        type(module).__name__ == "DbrxExperts"
        and all(isinstance(getattr(mlp, p, None), torch.Tensor) for p in ("w1", "v1", "w2"))
        and hasattr(module, "num_experts")
        and hasattr(module, "ffn_hidden_size")
    )


def fused_experts_reason(module: nn.Module) -> str | None:
    """Why the fused experts ``module`` (a transformers ``use_experts_implementation`` class, or Llama 4's
    ``Llama4TextExperts``) has no views, or ``None``.

    Checked: the parameter shapes agree with the class's layout (flags), and the module is not expert-parallel.
    """
    layout = experts_layout(module)
    if layout is None:
        return None
    if getattr(module, "_is_expert_parallel", False):
        return "expert-parallel experts (each rank holds a share of the experts)"
    first, has_gate, _, transposed, _ = layout
    up, down = getattr(module, first, None), getattr(module, "down_proj", None)
    if not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor) or up.dim() != 3 or down.dim() != 3:
        return f"no 3-D {first} and down_proj parameters"
    n = module.num_experts
    out_up = up.shape[2] if transposed else up.shape[1]
    in_down = down.shape[1] if transposed else down.shape[2]
    if up.shape[0] != n or down.shape[0] != n or out_up != (2 * in_down if has_gate else in_down):
        return f"{first} {list(up.shape)} and down_proj {list(down.shape)} do not match {n} experts"
    return None


def _build_views(module: nn.Module) -> dict[str, LinearView]:
    views: dict[str, LinearView] = {}
    if _is_conv1d(module):
        w = module.weight
        views[""] = LinearView(
            module, "weight", expert=None, transposed=True, in_features=w.shape[0], out_features=w.shape[1]
        )
    elif (layout := experts_layout(module)) is not None and fused_experts_reason(module) is None:
        first, has_gate, _, t, concatenated = layout
        up, down = getattr(module, first), module.down_proj
        hidden = up.shape[1] if t else up.shape[2]
        inter = down.shape[1] if t else down.shape[2]
        for e in range(module.num_experts):
            if has_gate:
                halves = (slice(0, inter), slice(inter, 2 * inter))  # concatenated; else interleaved (GPT-OSS)
                gate_rows, up_rows = halves if concatenated else (slice(0, None, 2), slice(1, None, 2))
                views[f"{e}.gate_proj"] = LinearView(
                    module, first, expert=e, transposed=t, rows=gate_rows, in_features=hidden,
                    out_features=inter,
                )  # fmt: skip
                views[f"{e}.up_proj"] = LinearView(
                    module, first, expert=e, transposed=t, rows=up_rows, in_features=hidden,
                    out_features=inter,
                )  # fmt: skip
            else:
                views[f"{e}.up_proj"] = LinearView(
                    module, first, expert=e, transposed=t, in_features=hidden, out_features=inter
                )
            views[f"{e}.down_proj"] = LinearView(
                module, "down_proj", expert=e, transposed=t, in_features=inter,
                out_features=hidden,
            )  # fmt: skip
    elif _is_dbrx(module):
        mlp, ffn = module.mlp, module.ffn_hidden_size
        hidden = mlp.w1.shape[-1]
        for e in range(module.num_experts):
            for pname, transposed in (("w1", False), ("v1", False), ("w2", True)):
                views[f"mlp.{e}.{pname}"] = LinearView(
                    mlp, pname, expert=e, transposed=transposed, block=ffn,
                    in_features=ffn if transposed else hidden, out_features=hidden if transposed else ffn,
                )  # fmt: skip
    return views


def weight_views(module: nn.Module) -> dict[str, LinearView]:
    """The Linear views of ``module``'s weights: ``{name suffix: LinearView}``, empty for any other module.

    * ``transformers.Conv1D``: ``{"": view}``, ``weight`` = the stored weight transposed ``[out, in]``;
    * a transformers fused-experts module (built with ``use_experts_implementation``, layout read from its
      ``has_gate`` / ``is_transposed`` / ``is_concatenated`` flags): per expert ``e``, ``"e.gate_proj"`` and
      ``"e.up_proj"`` (rows of ``gate_up_proj[e]``; only ``"e.up_proj"`` without a gate) and ``"e.down_proj"``;
      Llama 4's ``Llama4TextExperts`` the same (its layout fixed: transposed, gate then up columns);
    * DBRX's ``DbrxExperts``: ``"mlp.e.w1"``, ``"mlp.e.v1"`` (rows ``e * ffn ... (e+1) * ffn`` of
      ``mlp.w1`` / ``mlp.v1``) and ``"mlp.e.w2"`` (those rows of ``mlp.w2``, transposed).

    The full name of a view is ``f"{module name}.{suffix}"`` (the module's own name for Conv1D). The views are
    built once and cached for the module, off it (the same objects come back: hooks and results can be keyed on
    them; nothing is added to the module, so pickling it takes no view along), until the module is deleted or
    :func:`clear_weight_views`.
    """
    cached = _VIEWS.get(module)
    if cached is None:
        cached = _build_views(module)
        for view in cached.values():
            view.__dict__["_source"] = weakref.ref(module)
        _VIEWS[module] = cached
    return cached


def clear_weight_views(module: nn.Module) -> None:
    """Forget the views cached on ``module`` (after its parameters changed shape, e.g. experts dropped)."""
    _VIEWS.pop(module, None)


def router_names(named: list[tuple[str, nn.Module]]) -> list[str]:
    """Names of the Linear-like routers (gates) of the mixture-of-experts layers that have views.

    A router is a module with a 2-D weight of one row per expert the router chooses among that is a sibling of a
    viewable experts module (``mlp.gate`` next to ``mlp.experts``), or inside such a sibling (DBRX's
    ``ffn.router.layer``). The experts counted are ``num_experts`` plus the zero-compute (identity) experts the
    router also chooses among where the block has them (LongCat-Flash: ``mlp.router.classifier`` has
    ``n_routed_experts + zero_expert_num`` rows, the block's ``zero_expert_num``).
    """
    experts = {name: m for name, m in named if weight_views(m) and not _is_conv1d(m)}
    modules = dict(named)
    found = []
    for exp_name, module in experts.items():
        parent = exp_name.rsplit(".", 1)[0] if "." in exp_name else ""
        count = module.num_experts + (getattr(modules.get(parent), "zero_expert_num", 0) or 0)
        for name, sub in named:
            if name == exp_name or name.startswith(exp_name + ".") or not name.startswith(parent + "."):
                continue
            weight = getattr(sub, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == count:
                found.append(name)
    return found


def _routing_args(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden_states [tokens, hidden], top-k expert indices [tokens, k])`` from the experts module's call."""
    if len(args) >= 2:
        return args[0], args[1]
    forward = getattr(type(module).forward, "__wrapped__", type(module).forward)
    names = [p for p in inspect.signature(forward).parameters if p != "self"][:2]
    bound = list(args) + [kwargs[n] for n in names[len(args) :]]
    return bound[0], bound[1]


@torch.no_grad()
def observe_inputs(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, all_experts: bool, samples: int | None = None
) -> None:
    """Call each view of ``module`` on the input its matrix receives in ``module(*args, **kwargs)``.

    A forward pre-hook body (``with_kwargs=True``); the module's own forward then computes its output unchanged.
    Conv1D: its input. Experts: for expert ``e``, the tokens the router sent to it (``top_k_index == e``) go to
    ``gate_proj`` / ``up_proj`` (the same tensor, so statistics shared by input are shared), and their
    ``act(gate) * up`` (the module's own ``_apply_gate``, bias included) to ``down_proj``; with ``all_experts``,
    every token goes through every expert (for statistics only; the output still uses the router's choice).
    ``routed_tokens`` of the expert's views grows by the routed count either way. An expert that gets no token is
    not called. Llama 4's experts are called with every token once per expert, already multiplied by that expert's
    router score (the input its matrices compute on): expert ``e``'s routed tokens are the nonzero rows of its block
    (as scaled), and ``all_experts`` gives it every nonzero row of every block (each routed token as scaled for its
    own expert: llm-compressor 0.14's calibration of all experts on Llama 4 passes them the same rows, and the zero
    rows besides).

    ``samples``: the calibration samples (rows of the batch) the module's tokens come from, sample-major (a
    mixture-of-experts block flattens ``[batch, seq, hidden]`` to ``[batch * seq, hidden]`` before its experts);
    given, and dividing the token count, each expert's views are called once per sample with that sample's routed
    tokens, so that statistics kept per observation (input ranges: one observation per sample, as a Linear's
    ``[batch, seq, in]`` input gives them) do not depend on how the samples were batched.
    """
    views = weight_views(module)
    if not views:
        return
    if _is_conv1d(module):
        views[""](args[0])
        return
    per_sample = samples is not None and samples > 1
    if _is_llama4(module):  # [experts * tokens, hidden], scaled by the router: a zero row is a token not routed
        hidden = args[0] if args else kwargs["hidden_states"]
        blocks = hidden.reshape(module.num_experts, -1, hidden.shape[-1])
        parts = list(blocks.chunk(samples, dim=1)) if per_sample and blocks.shape[1] % samples == 0 else [blocks]
        for e in range(module.num_experts):
            names = [n for n in views if n.split(".")[-2] == str(e)]
            for part in parts:
                routed = (part[e] != 0).any(dim=-1)
                every = part.reshape(-1, part.shape[-1])
                every = every[(every != 0).any(dim=-1)] if all_experts else every
                _observe_expert(module, views, names, e, part[e], routed, every, all_experts=all_experts)
        return
    hidden, index = _routing_args(module, args, kwargs)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    index = index.reshape(hidden.shape[0], -1)
    chunks = [(hidden, index)]
    if per_sample and hidden.shape[0] % samples == 0:
        chunks = list(zip(hidden.chunk(samples), index.chunk(samples), strict=True))
    for e in range(module.num_experts):
        names = [n for n in views if n.split(".")[-2] == str(e)]
        for part, part_index in chunks:
            routed = (part_index == e).any(dim=-1)
            _observe_expert(module, views, names, e, part, routed, part, all_experts=all_experts)


def _observe_expert(
    module: nn.Module,
    views: dict[str, LinearView],
    names: list[str],
    e: int,
    tokens: torch.Tensor,
    routed: torch.Tensor,
    every: torch.Tensor,
    *,
    all_experts: bool,
) -> None:
    """:func:`observe_inputs` for expert ``e`` (views ``names``): ``tokens`` ``[n, hidden]`` of which the router
    sent ``routed`` (bool ``[n]``) to it, or ``every`` ``[m, hidden]`` token with ``all_experts``."""
    count = int(routed.sum())
    for n in names:
        views[n].routed_tokens += count
    x = every if all_experts else tokens[routed]
    if x.shape[0] == 0:
        return
    if _is_dbrx(module):
        mlp, pre = module.mlp, f"mlp.{e}."
        views[pre + "w1"](x)
        views[pre + "v1"](x)
        h = mlp.activation_fn(F.linear(x, views[pre + "w1"].weight)) * F.linear(x, views[pre + "v1"].weight)
        views[pre + "w2"](h)
        return
    first, has_gate, has_bias, transposed, _ = experts_layout(module)
    w = getattr(module, first)[e]
    bias = getattr(module, f"{first}_bias")[e] if has_bias else None
    out = F.linear(x, w.T if transposed else w, bias)
    if has_gate:
        views[f"{e}.gate_proj"](x)
        views[f"{e}.up_proj"](x)
        if hasattr(module, "_apply_gate"):
            h = module._apply_gate(out)
        else:  # Llama 4: gate columns, then up columns
            gate, up = out.chunk(2, dim=-1)
            h = module.act_fn(gate) * up
    else:
        views[f"{e}.up_proj"](x)
        h = module.act_fn(out)
    views[f"{e}.down_proj"](h)


def observe_view_inputs(
    register_hook: Callable[..., Any],
    targets: Mapping[str, nn.Module],
    done: Container[str] = (),
    *,
    all_experts: bool,
    model: nn.Module | None = None,
    owner: str | None = None,
) -> list[nn.Module]:
    """Hook every module whose views are among ``targets`` so that each view sees its own inputs.

    For each :class:`LinearView` in ``targets`` whose name is not in ``done`` (already compressed), its
    :attr:`~LinearView.source` (the fused experts module, or the ``Conv1D``) gets one forward pre-hook (kwargs
    included) that runs :func:`observe_inputs` (``all_experts`` passed on), and the ``routed_tokens`` of all that
    module's views are reset to ``0``. Modules seen through several targets are hooked once.

    Args:
        register_hook: the modifier's ``register_hook`` (:meth:`llmc_fsm.core.Modifier.register_hook`: the session
            removes the hooks at finalize), called as ``register_hook(module, hook, kind="forward_pre",
            with_kwargs=True)``.
        targets: ``{name: module}``, the modifier's resolved targets (modules that are not views are passed over).
        done: names of targets whose views need no more inputs.
        all_experts: every calibration token through every expert, for statistics only (:func:`observe_inputs`).
        model: the model holding the targets; given, each experts module's parent (the mixture-of-experts block,
            called with ``[batch, seq, hidden]``) also gets a forward pre-hook that records its batch's rows, and the
            experts' views are called once per sample (``samples`` of :func:`observe_inputs`).
        owner: the modifier's name; given, a modifier whose expert matrices' statistics come from their inputs
            says in one warning line, when ``all_experts`` is false and experts are hooked, that each expert is
            calibrated on its routed tokens where llm-compressor 0.14 by default calibrates every expert on every
            token (its ``moe_calibrate_all_experts=True``), and how to get that.

    Returns:
        The hooked modules, in the order of their first view in ``targets``.
    """
    sources: dict[int, nn.Module] = {}
    for name, view in targets.items():
        if isinstance(view, LinearView) and name not in done:
            sources.setdefault(id(view.source), view.source)
    rows: dict[int, int] = {}  # id(experts module) -> rows of the batch its parent was last called with
    if model is not None:
        names = {id(m): n for n, m in model.named_modules()}
        for source in sources.values():
            name = names.get(id(source))
            if name and not _is_conv1d(source):
                parent = model.get_submodule(name.rpartition(".")[0])
                record = functools.partial(_record_rows, rows, id(source))
                register_hook(parent, record, kind="forward_pre", with_kwargs=True)
    for source in sources.values():
        for view in weight_views(source).values():
            view.routed_tokens = 0
        hook = functools.partial(_observe_source, rows, all_experts=all_experts)
        register_hook(source, hook, kind="forward_pre", with_kwargs=True)
    if owner is not None and not all_experts and any(not _is_conv1d(s) for s in sources.values()):
        logger.warning(
            "%s: each fused expert matrix is calibrated on the tokens the router sent its expert "
            "(calibrate_all_experts: false); llm-compressor 0.14 calibrates every expert on every token by default "
            "(moe_calibrate_all_experts=True): set calibrate_all_experts: true on the modifier to calibrate as it does",
            owner,
        )
    return list(sources.values())


def _record_rows(rows: dict[int, int], key: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict) -> None:
    """Forward pre-hook of a mixture-of-experts block: the rows of its ``[batch, seq, hidden]`` input, for the
    experts module ``key`` it calls (:func:`observe_view_inputs`)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
        rows[key] = int(hidden.shape[0])


def _observe_source(
    rows: dict[int, int], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, all_experts: bool
) -> None:
    """Forward pre-hook of a module with views: :func:`observe_inputs`, per sample when its block's rows were
    recorded for this call."""
    observe_inputs(module, args, kwargs, all_experts=all_experts, samples=rows.pop(id(module), None))


def _marker(view: LinearView, param: torch.Tensor, start: int = 0) -> torch.Tensor:
    """A float64 tensor laid out like ``param`` but one input column wide, every entry distinct (``start`` + its
    position; give each parameter of a module its own ``start`` so that no two parameters' markers share a value).

    Reading a view's matrix from it (:meth:`LinearView.matrix_of`) gives ``[out_features, 1]``: which entries of the
    parameter are that view's rows, without allocating the parameter's size.
    """
    shape = list(param.shape)
    if view.block is not None or not view.transposed:
        shape[-1] = 1  # [experts, out, in] or DBRX's [experts * ffn, hidden]: rows kept, one column
    else:
        shape[-2] = 1  # transposed [experts, in, out]: the input dim is the one before last
    return torch.arange(start, start + math.prod(shape), dtype=torch.float64).reshape(shape)


def expert_checkpoint_names(model: nn.Module, name: str, module: nn.Module) -> dict[str, str]:
    """The checkpoint name of each expert matrix of the fused experts ``module`` (called ``name`` in ``model``).

    transformers 5 saves fused experts in the checkpoint's own layout through the model's conversion mapping
    (``revert_weight_conversion``, as ``save_pretrained`` does): Mixtral's ``mlp.experts.gate_up_proj`` becomes
    ``block_sparse_moe.experts.<e>.w1.weight`` / ``w3.weight``, Qwen2/3-MoE's and DeepSeek-V3's
    ``mlp.experts.<e>.gate_proj.weight`` ... . Which per-expert key holds which view's matrix is read by converting
    marker tensors (one column wide, every entry distinct) with that same mapping, so the names are transformers'
    own, not a copy of its table.

    Args:
        model: a transformers ``PreTrainedModel`` holding ``module``.
        name: ``module``'s full name in ``model`` (as in ``model.state_dict()`` keys).
        module: a fused experts module with views (:func:`weight_views`).

    Returns:
        ``{view suffix: checkpoint module name}``, e.g. ``"0.gate_proj"`` ->
        ``"model.layers.0.block_sparse_moe.experts.0.w1"``
        (its tensors are ``<name>.weight``, or compressed-tensors' ``<name>.weight_packed`` ...).

    Raises:
        ValueError: (one line, why) the family's checkpoint keeps the fused tensors (no per-expert key: GPT-OSS,
            DBRX; transformers 5.24 then reloads neither per-expert nor fused packed tensors into them, measured:
            docs/architectures.md), a per-expert key is not one view's ``[out, in]`` matrix, or the per-expert names
            would not be written as given (the conversion would rename them again).
    """
    from transformers.core_model_loading import revert_weight_conversion  # optional third-party: transformers

    views = weight_views(module)
    params = {v.param_name: getattr(v.owner, v.param_name) for v in views.values()}
    prefix = name + "." if name else ""
    owner_prefix = prefix + ("mlp." if _is_dbrx(module) else "")
    first = next(iter(views.values()))
    markers, start = {}, 0
    for pname, p in params.items():  # disjoint values: square experts (down_proj [H, I] with I == H) stay apart
        markers[pname] = _marker(first, p, start)
        start += markers[pname].numel()
    reverted = revert_weight_conversion(model, {owner_prefix + p: m for p, m in markers.items()})
    kept = [k for k in reverted if k.startswith(owner_prefix) and k.removeprefix(owner_prefix) in markers]
    tail = re.sub(r"^(.*\.)?\d+\.", "", name)  # the experts' name inside their layer: mlp.experts
    advice = (
        f"to quantize the rest of the model, add 're:.*{tail}' to the modifier's ignore (the experts are then saved "
        "dense, as they are, and reload)"
    )
    if kept:
        msg = (
            f"transformers saves {', '.join(kept)} fused in the checkpoint (its conversion mapping has no per-expert "
            "key for them) and reads compressed-tensors quantized weights into fused experts only through such a "
            f"per-expert mapping: quantized per expert they reload as unexpected keys with {kept[0]} missing "
            "(randomly initialised; measured on transformers 5.24, and on 5.25 with llm-compressor 0.14's "
            "Qwen3-VL-MoE checkpoints: packed int4, NVFP4, and FP8 weights with their scales), packed under the fused "
            f"name as unexpected {kept[0]}.weight_packed ... keys (5.24), so no quantized experts can be written "
            f"that it reloads; {advice}"
        )
        raise ValueError(msg)
    names: dict[str, str] = {}
    for key, tensor in reverted.items():
        found = [
            s for s, v in views.items()
            if tuple(tensor.shape) == (v.out_features, 1) and torch.equal(tensor, v.matrix_of(markers[v.param_name]))
        ]  # fmt: skip
        if len(found) != 1 or not key.endswith(".weight"):
            msg = (
                f"the checkpoint key {key} is not one expert matrix stored as a Linear weight [out, in]: "
                "transformers writes these experts in a layout of its own (e.g. Granite-MoE's "
                "input_linear / output_linear, every expert in one tensor) and reads compressed-tensors packed "
                "weights into fused experts only through one [out, in] key per expert, so no quantized experts can "
                f"be written that it reloads; {advice}"
            )
            raise ValueError(msg)
        names[found[0]] = key.removesuffix(".weight")
    missing = [s for s in views if s not in names]
    if missing:
        raise ValueError(f"no checkpoint key holds the expert matrix {prefix}{missing[0]}")
    probe = {n + ".weight_packed": torch.zeros(1) for n in names.values()}
    renamed = sorted(set(revert_weight_conversion(model, probe)) - set(probe))
    if renamed:
        msg = f"saving would rename the per-expert key {sorted(probe)[0]} (to e.g. {renamed[0]})"
        raise ValueError(msg)
    return names


def linear_expert_names(model: nn.Module, name: str, module: nn.Module) -> dict[str, str] | None:
    """Per-expert checkpoint names of fused experts that transformers replaces by one Linear module per expert
    matrix when it loads a compressed-tensors checkpoint, or ``None`` for other experts.

    Llama 4: transformers saves ``Llama4TextExperts`` fused (``feed_forward.experts.gate_up_proj`` / ``down_proj``,
    no per-expert key: :func:`expert_checkpoint_names` raises), and its quantizers put a module of its
    ``MODULES_TO_PATCH_FOR_QUANTIZATION`` table in their place before loading a quantized checkpoint
    (``SequentialLlama4TextExperts``: per expert ``e`` a ``Llama4TextMLP`` with ``gate_proj`` / ``up_proj`` /
    ``down_proj`` Linears, which compressed-tensors then quantizes like any Linear). The names are read from that
    module, built on the ``meta`` device from the model's text config as transformers builds it, and must be the
    view suffixes, each Linear of its view's shape; vLLM's Llama 4 loader reads the same per-expert names, and
    llm-compressor 0.14 writes a quantized Llama 4 so.

    Args:
        model: a transformers ``PreTrainedModel`` holding ``module``.
        name: ``module``'s full name in ``model``.
        module: a fused experts module with views (:func:`weight_views`).

    Returns:
        ``{view suffix: checkpoint module name}`` (``"0.gate_proj"`` ->
        ``"language_model.model.layers.1.feed_forward.experts.0.gate_proj"``), or ``None`` (the installed
        transformers patches no such class for compressed-tensors checkpoints).

    Raises:
        ValueError: (one line) the patched module's Linears are not the views (names or shapes), or saving would
            rename the per-expert keys.
    """
    from transformers.core_model_loading import revert_weight_conversion  # optional third-party: transformers

    entry = _patch_entry(module)
    views = weight_views(module)
    if not views or entry is None:
        return None
    with torch.device("meta"):
        patched = entry["module_name"](model.config.get_text_config())
    linears = {n: tuple(m.weight.shape) for n, m in patched.named_modules() if isinstance(m, nn.Linear)}
    shapes = {s: (v.out_features, v.in_features) for s, v in views.items()}
    if linears != shapes:
        msg = (
            f"transformers reloads {type(module).__name__} as {type(patched).__name__}, whose Linear modules "
            f"({', '.join(sorted(linears)[:3])} ...) are not its expert matrices ({', '.join(sorted(shapes)[:3])} ...)"
        )
        raise ValueError(msg)
    prefix = name + "." if name else ""
    fused = next(iter(revert_weight_conversion(model, {prefix + "down_proj": torch.zeros(1)})))
    saved = fused.removesuffix("down_proj")
    names = {suffix: saved + suffix for suffix in views}
    probe = {n + ".weight_packed": torch.zeros(1) for n in names.values()}
    renamed = sorted(set(revert_weight_conversion(model, probe)) - set(probe))
    if renamed:
        raise ValueError(f"saving would rename the per-expert key {sorted(probe)[0]} (to e.g. {renamed[0]})")
    return names


def reloads_as_linears(module: nn.Module) -> bool:
    """Whether transformers replaces the experts module ``module`` by one Linear module per expert matrix when it
    loads a compressed-tensors checkpoint (its quantizers' ``MODULES_TO_PATCH_FOR_QUANTIZATION`` table: Llama 4's
    ``Llama4TextExperts``), so that a checkpoint keeping them fused does not reload them, quantized or not."""
    return _patch_entry(module) is not None


def _patch_entry(module: nn.Module) -> dict[str, Any] | None:
    """transformers' ``MODULES_TO_PATCH_FOR_QUANTIZATION`` entry for ``module``'s class when it applies to
    compressed-tensors checkpoints, else ``None`` (also when the installed transformers has no such table)."""
    try:
        from transformers.quantizers.base import MODULES_TO_PATCH_FOR_QUANTIZATION
        from transformers.utils.quantization_config import QuantizationMethod
    except ImportError:  # optional third-party: transformers (the table is its quantizers' own)
        return None
    entry = MODULES_TO_PATCH_FOR_QUANTIZATION.get(type(module).__name__)
    if entry is None or QuantizationMethod.COMPRESSED_TENSORS not in entry["quantization_methods"]:
        return None
    return entry


def quantize_expert_inputs(module: nn.Module) -> bool:
    """Make the experts ``module`` compute as transformers computes them after reloading its compressed checkpoint,
    where it reloads them as one Linear per expert matrix (:func:`reloads_as_linears`: Llama 4) and some expert matrix
    quantizes its input activations: returns whether it did.

    transformers reloads each expert as a ``Llama4TextMLP`` whose Linears compressed-tensors quantizes, their inputs
    included (``forward_quantize`` of each Linear's input: dynamic per token or group, NVFP4's groups under the saved
    ``input_global_scale``, or static with the saved ``input_scale``). The module's ``forward`` becomes that: per
    expert ``e``, ``down(act(gate(x_e)) * up(x_e))`` on its block of the input, each matrix's input quantized with its
    view's ``quantization_scheme`` and ``quantized_params`` (an expert matrix left dense: not quantized), so the
    in-memory model gives the reloaded one's outputs (tested equal). With compressed-tensors' switch
    ``quantization_enabled`` off on the module (the sequential pipeline's propagation) the class's own forward runs.
    Idempotent; call it again after the views' quantization changed (a resumed layer).
    """
    views = weight_views(module)
    if not views or not _is_llama4(module) or not reloads_as_linears(module):
        return False
    if not any(getattr(getattr(v, "quantization_scheme", None), "input_activations", None) for v in views.values()):
        return False
    module.__dict__["forward"] = functools.partial(_forward_with_quantized_inputs, module)
    return True


def _forward_with_quantized_inputs(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """:func:`quantize_expert_inputs`' forward of Llama 4's experts (``[experts * tokens, hidden]`` in and out)."""
    if module.__dict__.get("quantization_enabled", True) is False:
        return type(module).forward(module, hidden_states)
    views = weight_views(module)
    hidden = hidden_states.reshape(module.num_experts, -1, hidden_states.shape[-1])
    out = torch.zeros_like(hidden)
    for e in range(module.num_experts):
        x = hidden[e]
        gate, up, down = (views[f"{e}.{m}"] for m in ("gate_proj", "up_proj", "down_proj"))
        h = module.act_fn(_linear(gate, x)) * _linear(up, x)
        out[e] = _linear(down, h)
    return out.reshape(-1, hidden_states.shape[-1])


def _linear(view: LinearView, x: torch.Tensor) -> torch.Tensor:
    """``view``'s matrix applied to ``x`` as a compressed-tensors quantized Linear of a reloaded checkpoint applies
    its weight: the input quantized first where the view's scheme says so."""
    scheme = getattr(view, "quantization_scheme", None)
    args = getattr(scheme, "input_activations", None)
    if args is not None:
        from compressed_tensors.quantization import QuantizationStatus
        from compressed_tensors.quantization.lifecycle.forward import forward_quantize

        # the view's parameters follow the model's device and, as a Linear's ``input_scale`` does, its dtype
        # (``model.to(...)`` does not reach them: found by a tester, ``model.to(torch.float32)`` then raised)
        params = {k: v.to(x.device) for k, v in view.quantized_params.items()}
        scale = params.get("input_scale")
        shim = SimpleNamespace(
            quantization_status=QuantizationStatus.COMPRESSED,
            input_scale=scale.to(view.weight.dtype) if scale is not None else None,
            input_zero_point=params.get("input_zero_point"),
            input_global_scale=params.get("input_global_scale"),
        )
        x = forward_quantize(shim, x, "input", args)
    return F.linear(x, view.weight.contiguous())
