"""Public toolkit for modifier authors: the calibrated-modifier base, the OBS sweep, targets, layer error, ranks.

Everything a third-party modifier needs beyond ``llmc_fsm`` itself (``Modifier``, ``State``, ``Event``,
``hookimpl`` and the errors) is importable from here, and only the names in ``__all__`` are public: the
submodules (``llmc_fsm.toolkit.obs`` and so on) and anything not listed may change between versions. The first-party
plugins (``plugins/pruning``, ``plugins/quantization``, ``plugins/training``) import nothing else
(``tests/test_toolkit_example.py`` checks it). ``docs/plugins.md``, "Writing a calibrated modifier", shows how the
pieces fit; ``docs/examples/llmc-fsm-clip-rtn`` is a complete third-party distribution built on them.

Conventions: a Linear weight is ``[out_features, in_features]`` (rows = outputs); statistics and algorithm math are
float32 unless a name says otherwise; errors are ``ValueError`` for bad input (raised before any work),
``DistributedError`` for a failed collective.

The public names, by concern:

* **calibrated modifiers** (:mod:`~llmc_fsm.toolkit.calibrated`): :class:`CalibratedModifier` (the base class: target
  selection and checks, calibration hooks, compression per decoder layer, results, ``torch.distributed``),
  :class:`ModuleResult` (what compressing one module did), :class:`CompressedGroup` (new weights with their
  measured output errors), :func:`patterns` (the attrs converter of ``targets`` / ``ignore`` fields),
  :func:`nonfinite_weights` (the modules whose weight holds NaN/Inf, to refuse before changing anything),
  :func:`own_forwards` (a block of a modifier's own forwards, which no registered hook takes for calibration);
* **optimal brain surgeon** (:mod:`~llmc_fsm.toolkit.obs`; GPTQ arXiv 2210.17323 Sec. 3-4, SparseGPT arXiv
  2301.00774 Sec. 3): :class:`HessianAccumulator` (``H = 2/n X^T X``), :func:`inverse_hessian_cholesky`
  (damping and the Cholesky factor of ``H^-1``) returning :class:`InverseHessianFactor`, :func:`obs_sweep` (the
  column sweep with lazy batch updates) driven by a :class:`ColumnRule` (or a :class:`MaskRule`, one product per
  column where a column's mask is fixed when the sweep reaches it), :func:`check_dampening_frac` and
  :data:`MAX_DAMPENING_FRAC`, :data:`SUB_BLOCK` (the sweep's default inner block, 32 columns),
  :class:`HessianNotPositiveDefiniteError`;
* **layer error** (:mod:`~llmc_fsm.toolkit.layer_error`): :func:`relative_output_error`
  (``||W X - W_hat X|| / ||W X||`` from ``H``), :func:`sweep_relative_errors` (the same from an OBS sweep's terms);
* **targets** (:mod:`~llmc_fsm.toolkit.targets`): :func:`select_targets` returning :class:`TargetSelection`,
  :func:`resolve_targets` (the same, with warnings), :func:`matches`, :func:`match_precedence` (which of
  several config groups' targets a module takes, as compressed-tensors orders them), :func:`is_linear_like`,
  :func:`is_peft_tuner_layer`, :func:`compact_names`,
  :data:`DEFAULT_TARGETS` (``("Linear",)``), :data:`DEFAULT_IGNORE` (``("lm_head",)``),
  :func:`check_not_quantized` (refuses a model whose config says it is quantized), :func:`model_family` (a
  model's class and ``model_type`` for messages), :func:`tied_head` / :func:`untie_head` (an output head tied to
  the input embedding, and giving it a weight of its own), :func:`weights_shared_across_layers` (Zamba's shared
  block: weights several decoder layers hold);
* **views** (:mod:`~llmc_fsm.toolkit.views`): :class:`LinearView` (one matrix of a fused mixture-of-experts
  parameter, or a ``Conv1D`` weight, seen as a Linear weight sharing its storage), :func:`weight_views` (a module's
  views), :func:`observe_inputs` (feed the views the inputs their matrices receive: per expert, its routed tokens;
  :func:`observe_view_inputs` registers it on every module whose views a modifier targets),
  :func:`router_names`, :func:`fused_experts_reason`, :func:`experts_layout` (:class:`ExpertsLayout`: how fused
  experts keep their matrices), :func:`clear_weight_views` (after a module's
  parameters changed shape), :func:`expert_checkpoint_names` (the per-expert checkpoint names of fused experts),
  :func:`linear_expert_names` (those of experts transformers reloads as one Linear per expert matrix: Llama 4),
  :func:`reloads_as_linears` (whether it does so for a module), :func:`quantize_expert_inputs` (such experts then
  compute as the reloaded Linears do, inputs quantized);
* **masks** (:mod:`~llmc_fsm.toolkit.masks`): :func:`pack_mask` / :func:`unpack_mask` (bool <-> bit-packed uint8);
* **ranks** (:mod:`~llmc_fsm.toolkit.distributed`): :func:`is_distributed`, :func:`get_rank`,
  :func:`get_world_size`, :func:`is_main_process`, :func:`all_reduce_tensor`, :func:`all_gather_ints`,
  :func:`all_gather_rows`, :func:`all_reduce_accumulator`, :func:`check_same_values`, :class:`DistributedError`;
* **memory** (:mod:`~llmc_fsm.toolkit.heap`): :func:`trim_heap` (give glibc's free heap pages back),
  :func:`private_pages` (whether a weight's storage is private memory already: write into it rather than replace it),
  :func:`release_file_pages` (unmap a replaced weight's unwritten pages of a memory-mapped checkpoint);
* **checkpoint** (:mod:`~llmc_fsm.toolkit.packed`): :func:`keep_packed` (keep the tensors compressed-tensors
  packed when a module was quantized, for the save to write instead of rounding again), :func:`weight_formats` /
  :func:`format_problem` (the compressed-tensors formats a scheme's weights can be saved in; :func:`saved_as`: the
  class whose formats a module takes),
  :func:`expert_reload_problem` (why transformers would not reload fused experts quantized with a scheme),
  :func:`experts_for_vllm` (whether such experts are still written per expert as vLLM reads them: NVFP4, FP8 block),
  :func:`scheme_label` (the report's short label of a scheme: ``int4/g64``, ``fp8 a:fp8``).

Imports only :mod:`llmc_fsm.core`.
"""

from llmc_fsm.core.modifier import own_forwards
from llmc_fsm.toolkit.calibrated import CalibratedModifier, CompressedGroup, ModuleResult, nonfinite_weights, patterns
from llmc_fsm.toolkit.distributed import (
    DistributedError,
    all_gather_ints,
    all_gather_rows,
    all_reduce_accumulator,
    all_reduce_tensor,
    check_same_values,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_process,
)
from llmc_fsm.toolkit.heap import private_pages, release_file_pages, trim_heap
from llmc_fsm.toolkit.layer_error import relative_output_error, sweep_relative_errors
from llmc_fsm.toolkit.masks import pack_mask, unpack_mask
from llmc_fsm.toolkit.obs import (
    MAX_DAMPENING_FRAC,
    SUB_BLOCK,
    ColumnRule,
    HessianAccumulator,
    HessianNotPositiveDefiniteError,
    InverseHessianFactor,
    MaskRule,
    check_dampening_frac,
    inverse_hessian_cholesky,
    obs_sweep,
)
from llmc_fsm.toolkit.packed import (
    expert_reload_problem,
    experts_for_vllm,
    format_problem,
    keep_packed,
    saved_as,
    scheme_label,
    weight_formats,
)
from llmc_fsm.toolkit.targets import (
    DEFAULT_IGNORE,
    DEFAULT_TARGETS,
    TargetSelection,
    check_not_quantized,
    compact_names,
    is_linear_like,
    is_peft_tuner_layer,
    match_precedence,
    matches,
    model_family,
    resolve_targets,
    select_targets,
    tied_head,
    untie_head,
    weights_shared_across_layers,
)
from llmc_fsm.toolkit.views import (
    ExpertsLayout,
    LinearView,
    clear_weight_views,
    expert_checkpoint_names,
    experts_layout,
    fused_experts_reason,
    linear_expert_names,
    observe_inputs,
    observe_view_inputs,
    quantize_expert_inputs,
    reloads_as_linears,
    router_names,
    weight_views,
)

__all__ = [
    "DEFAULT_IGNORE",
    "DEFAULT_TARGETS",
    "MAX_DAMPENING_FRAC",
    "SUB_BLOCK",
    "CalibratedModifier",
    "ColumnRule",
    "CompressedGroup",
    "DistributedError",
    "ExpertsLayout",
    "HessianAccumulator",
    "HessianNotPositiveDefiniteError",
    "InverseHessianFactor",
    "LinearView",
    "MaskRule",
    "ModuleResult",
    "TargetSelection",
    "all_gather_ints",
    "all_gather_rows",
    "all_reduce_accumulator",
    "all_reduce_tensor",
    "check_dampening_frac",
    "check_not_quantized",
    "check_same_values",
    "clear_weight_views",
    "compact_names",
    "expert_checkpoint_names",
    "expert_reload_problem",
    "experts_for_vllm",
    "experts_layout",
    "format_problem",
    "fused_experts_reason",
    "get_rank",
    "get_world_size",
    "inverse_hessian_cholesky",
    "is_distributed",
    "is_linear_like",
    "is_main_process",
    "is_peft_tuner_layer",
    "keep_packed",
    "linear_expert_names",
    "match_precedence",
    "matches",
    "model_family",
    "nonfinite_weights",
    "obs_sweep",
    "observe_inputs",
    "observe_view_inputs",
    "own_forwards",
    "pack_mask",
    "patterns",
    "private_pages",
    "quantize_expert_inputs",
    "relative_output_error",
    "release_file_pages",
    "reloads_as_linears",
    "resolve_targets",
    "router_names",
    "saved_as",
    "scheme_label",
    "select_targets",
    "sweep_relative_errors",
    "tied_head",
    "trim_heap",
    "unpack_mask",
    "untie_head",
    "weight_formats",
    "weight_views",
    "weights_shared_across_layers",
]
