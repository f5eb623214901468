"""Recipes written for llm-compressor run unchanged (issue 11, Ecosystem).

Each recipe below is in llm-compressor's style (stage -> ``<group>_modifiers`` ->
modifier, ``run_type``, its argument names and ``re:`` patterns). Where it runs
a model, the reference is the same compression written as a native llmc-fsm
recipe: both must leave bit-identical weights, so a translation that changed a
meaning would fail here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from llmc_fsm_pruning import ConstantPruningModifier, MagnitudePruningModifier
from test_targets import LINEARS, llama

from llmc_fsm import RecipeError, Session
from llmc_fsm.integrations.torch import initialize, optimizer_step
from llmc_fsm.pipeline.sequential import run_sequential
from llmc_fsm.recipes.building import resolve_recipe
from llmc_fsm.recipes.fingerprint import recipe_fingerprint

DATA = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))


def oneshot(recipe, model):
    session = Session(recipe)
    session.initialize(model=model, calibration_data=DATA)
    run_sequential(session, batch_size=4, progress=False)
    session.finalize()
    return model


def train(recipe, model, steps: int = 6):
    session = Session(recipe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=2)
    for i in range(steps):
        batch = {"input_ids": DATA[i % 8 : i % 8 + 2], "labels": DATA[i % 8 : i % 8 + 2]}
        session.batch_start(batch=batch)
        session.loss_calculated(model(**batch).loss).backward()
        optimizer_step(session, optimizer)
        session.batch_end()
    session.finalize()
    return model


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def layer_linears(model):
    return {f"{i}.{n}": model.model.layers[i].get_submodule(n) for i in range(2) for n in LINEARS}


# --- one-shot pruning ------------------------------------------------------------------------------


SPARSEGPT_24 = r"""
sparsity_stage:
  run_type: oneshot
  sparsity_modifiers:
    SparseGPTModifier:
      sparsity: 0.5
      mask_structure: "2:4"
      sequential_update: false
      targets: ['re:model.layers.\d*$']
      ignore: ['re:.*lm_head']
      block_size: 128
      dampening_frac: 0.01
      offload_hessians: false
"""


def test_sparsegpt_recipe_prunes_2_4_exactly_like_the_native_recipe():
    model = llama(tied=True)
    embed = model.model.embed_tokens.weight.clone()
    theirs = oneshot(SPARSEGPT_24, copy.deepcopy(model))
    ours = oneshot({"prune": {"SparseGPTModifier": {"sparsity": 0.5, "mask_structure": "2:4"}}}, model)
    same_weights(theirs, ours)
    for name, module in layer_linears(theirs).items():
        groups = module.weight.reshape(-1, 4)
        assert ((groups == 0).sum(dim=1) >= 2).all(), name
        assert int((module.weight == 0).sum()) == module.weight.numel() // 2, name
    assert torch.equal(theirs.model.embed_tokens.weight, embed)  # the tied head stayed dense


def test_wanda_recipe_with_llmcompressor_unstructured_spelling():
    recipe = """
pruning_stage:
  run_type: oneshot
  pruning_modifiers:
    WandaPruningModifier:
      sparsity: 0.3
      mask_structure: "0:0"
      sequential_update: true
      targets: [Linear]
      ignore: [lm_head]
"""
    model = llama(tied=True)
    theirs = oneshot(recipe, copy.deepcopy(model))
    ours = oneshot({"prune": {"WandaPruningModifier": {"sparsity": 0.3}}}, model)
    same_weights(theirs, ours)
    q = theirs.model.layers[0].self_attn.q_proj.weight
    assert int((q == 0).sum()) == round(0.3 * 16) * 16  # per output row: 0.3 of 16 inputs, rounded


# --- training stages --------------------------------------------------------------------------------


def test_magnitude_pruning_train_stage():
    recipe = """
pruning_stage:
  run_type: train
  pruning_modifiers:
    MagnitudePruningModifier:
      targets: __ALL_PRUNABLE__
      init_sparsity: 0.05
      final_sparsity: 0.5
      start: 0
      end: 2
      update: 1
      mask_structure: unstructured
      leave_enabled: true
      update_scheduler: cubic
      scheduler_args: {}
      apply_globally: false
"""
    (mod,) = resolve_recipe(recipe).modifiers
    assert isinstance(mod, MagnitudePruningModifier)
    assert (mod.init_sparsity, mod.final_sparsity, mod.start, mod.end, mod.update) == (0.05, 0.5, 0.0, 2.0, 1.0)
    model = llama(tied=True)
    native = {
        "prune": {
            "MagnitudePruningModifier": {
                "init_sparsity": 0.05,
                "final_sparsity": 0.5,
                "start": 0,
                "end": 2,
                "update": 1,
            }
        }
    }
    theirs = train(recipe, copy.deepcopy(model), steps=4)  # 2 epochs: until end
    ours = train(native, model, steps=4)
    same_weights(theirs, ours)
    for name, module in layer_linears(theirs).items():
        assert int((module.weight == 0).sum()) == module.weight.numel() // 2, name


def test_constant_pruning_train_stage_with_parameter_targets():
    recipe = """
finetuning_stage:
  run_type: train
  finetuning_modifiers:
    ConstantPruningModifier:
      targets: ['re:.*q_proj.weight', 're:.*k_proj.weight', 're:.*v_proj.weight', 're:.*o_proj.weight',
                're:.*gate_proj.weight', 're:.*up_proj.weight', 're:.*down_proj.weight']
      start: 0
"""
    (mod,) = resolve_recipe(recipe).modifiers
    assert isinstance(mod, ConstantPruningModifier)
    model = oneshot({"p": {"SparseGPTModifier": {"mask_structure": "2:4"}}}, llama(tied=True))
    zeros = {name: m.weight == 0 for name, m in layer_linears(model).items()}
    theirs = train(recipe, copy.deepcopy(model))
    ours = train({"hold": [ConstantPruningModifier(start=0)]}, model)
    same_weights(theirs, ours)
    for name, module in layer_linears(theirs).items():
        assert torch.equal(module.weight == 0, zeros[name]), name
    assert sorted(theirs.model.layers[0].mlp.up_proj.weight.shape) == [16, 32]


def test_training_modifiers_in_llmcompressor_nesting():
    recipe = """
train_stage:
  run_type: train
  distillation_modifiers:
    OutputDistillationModifier: {temperature: 3.0, alpha: 0.7}
  lr_modifiers:
    LearningRateModifier: {init_lr: 0.01, schedule: cosine, start: 0, end: 2}
"""
    recipe = resolve_recipe(recipe)
    (stage,) = recipe.stages
    assert (stage.name, stage.run_type) == ("train_stage", "train")
    distill, lr = stage.modifiers
    assert (type(distill).__name__, distill.temperature, distill.alpha) == ("OutputDistillationModifier", 3.0, 0.7)
    assert (type(lr).__name__, lr.init_lr, lr.schedule, lr.end) == ("LearningRateModifier", 0.01, "cosine", 2.0)
    # llm-compressor's OutputDistillationModifier is a different modifier: its arguments are not ours
    with pytest.raises(RecipeError) as info:
        resolve_recipe("s:\n  d_modifiers:\n    OutputDistillationModifier: {comparison: kl_divergence}\n")
    assert str(info.value).startswith(
        "recipe <text>, line 3, stage 's', modifier OutputDistillationModifier: unknown argument 'comparison'."
    )


# --- quantization (from the llmc-fsm-quantization plugin) --------------------------------------------------


def test_gptq_recipe_with_config_groups_quantizes_like_the_native_recipe():
    pytest.importorskip("llmc_fsm_quantization", reason="the llmc-fsm-quantization plugin is not installed")
    recipe = """
quantization_stage:
  run_type: oneshot
  quantization_modifiers:
    GPTQModifier:
      ignore: [lm_head]
      sequential_update: true
      offload_hessians: false
      block_size: 128
      dampening_frac: 0.01
      actorder: static
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 8}
"""
    (mod,) = resolve_recipe(recipe).modifiers
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 8}
    assert mod.config_groups == {"group_0": {"targets": ["Linear"], "weights": weights}}  # read as it is
    assert list(mod.targets) == ["Linear"]
    native = {"q": {"GPTQModifier": {"scheme": {"weights": weights}, "actorder": "static"}}}
    model = llama(tied=True)
    theirs = oneshot(recipe, copy.deepcopy(model))
    same_weights(theirs, oneshot(native, model))
    for name, module in layer_linears(theirs).items():  # 4 bits: at most 16 values per group of 8 inputs
        groups = module.weight.detach().reshape(module.weight.shape[0], -1, 8)
        assert max(len(torch.unique(g)) for row in groups for g in row) <= 16, name


#: llm-compressor 0.14.0.1's saved recipe.yaml (what ``oneshot`` writes next to the model, yaml.dump of its modifiers:
#: ``default_stage``, every argument with its value, ``requires_calibration_data``, compressed-tensors'
#: ActivationOrdering as a Python object tag), the form found in published checkpoints; widths made to fit the tiny
#: Llama (group 8).
LLMCOMPRESSOR_SAVED = """default_stage:
  default_modifiers:
    GPTQModifier:
      config_groups:
        g:
          targets: [Linear]
          weights:
            num_bits: 4
            type: int
            symmetric: true
            group_size: 8
            strategy: group
            block_structure: null
            dynamic: false
            actorder: !!python/object/apply:compressed_tensors.quantization.quant_args.ActivationOrdering [
              static]
            scale_dtype: null
            zp_dtype: null
            observer: memoryless_minmax
            observer_kwargs: {}
          input_activations: null
          output_activations: null
          format: null
      targets: [Linear]
      ignore: [lm_head]
      bypass_divisibility_checks: false
      requires_calibration_data: true
      block_size: 128
      dampening_frac: 0.01
      actorder: static
      batched_quantization: auto
"""


def test_llmcompressor_s_saved_recipe_yaml_runs_as_the_recipe_it_records(caplog):
    """Found by a tester (session 26): llm-compressor's own saved recipe.yaml was refused (a Python object tag for
    actorder, ``requires_calibration_data``, ``batched_quantization``). It now reads (the tag as its string value,
    nothing imported; the two arguments accepted and ignored, each said in one line) and quantizes bit for bit as the
    native recipe of the same GPTQ W4 group 8 with static activation order; any other Python object tag is still
    refused as not valid YAML."""
    pytest.importorskip("llmc_fsm_quantization", reason="the llmc-fsm-quantization plugin is not installed")
    import logging

    with caplog.at_level(logging.WARNING, logger="llmc_fsm.recipes.llmcompressor"):
        (mod,) = resolve_recipe(LLMCOMPRESSOR_SAVED).modifiers
    assert mod.config_groups["g"]["weights"]["actorder"] == "static" and mod.actorder == "static"
    lines = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    ignored = sorted(line.split("'")[1] for line in lines)
    assert ignored == ["batched_quantization", "bypass_divisibility_checks", "requires_calibration_data"]
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 8}
    native = {"q": {"GPTQModifier": {"scheme": {"weights": weights}, "actorder": "static"}}}
    model = llama(tied=True)
    same_weights(oneshot(LLMCOMPRESSOR_SAVED, copy.deepcopy(model)), oneshot(native, model))
    evil = LLMCOMPRESSOR_SAVED.replace("compressed_tensors.quantization.quant_args.ActivationOrdering", "os.system")
    with pytest.raises(RecipeError, match="could not determine a constructor for the tag"):
        resolve_recipe(evil)


#: llm-compressor 0.14.0.1's saved SmoothQuant recipe (its inferred mappings as Python tuples, ``algorithm``).
LLMCOMPRESSOR_SAVED_SMOOTHQUANT = """default_stage:
  default_modifiers:
    SmoothQuantModifier:
      requires_calibration_data: true
      smoothing_strength: 0.5
      mappings:
      - !!python/tuple
        - ['re:.*q_proj', 're:.*k_proj', 're:.*v_proj']
        - re:.*input_layernorm
      - !!python/tuple
        - ['re:.*gate_proj', 're:.*up_proj']
        - re:.*post_attention_layernorm
      ignore: []
      algorithm: ALGORITHM
    QuantizationModifier:
      targets: [Linear]
      ignore: [lm_head]
      scheme: W8A8
      bypass_divisibility_checks: false
      requires_calibration_data: false
"""


def test_llmcompressor_s_saved_smoothing_recipes_run_as_the_recipes_they_record():
    """Found by a tester (session 26): every saved SmoothQuant recipe was refused (``!!python/tuple`` mappings,
    ``algorithm``). The tuples read as lists (its own mappings, the same as ours by default here: the same weights
    as the native recipe); ``algorithm: log_equalization`` (llm-compressor's replacement for
    LogarithmicEqualizationModifier) gives that modifier's weights; LogarithmicEqualizationModifier refuses another
    algorithm."""
    pytest.importorskip("llmc_fsm_quantization", reason="the llmc-fsm-quantization plugin is not installed")
    model = llama(tied=True)
    native = {"s": {"SmoothQuantModifier": {"smoothing_strength": 0.5},
                    "QuantizationModifier": {"scheme": "W8A8", "ignore": ["lm_head"]}}}  # fmt: skip
    saved = LLMCOMPRESSOR_SAVED_SMOOTHQUANT.replace("ALGORITHM", "smoothquant")
    same_weights(oneshot(saved, copy.deepcopy(model)), oneshot(native, copy.deepcopy(model)))
    logeq = {"s": {"LogarithmicEqualizationModifier": {},
                   "QuantizationModifier": {"scheme": "W8A8", "ignore": ["lm_head"]}}}  # fmt: skip
    saved = LLMCOMPRESSOR_SAVED_SMOOTHQUANT.replace("ALGORITHM", "log_equalization")
    with_log = oneshot(saved, copy.deepcopy(model))
    same_weights(with_log, oneshot(logeq, copy.deepcopy(model)))
    q_proj = [m.model.layers[0].self_attn.q_proj.weight for m in (with_log, model)]
    assert not torch.equal(*q_proj)
    with pytest.raises(RecipeError, match="LogarithmicEqualizationModifier is algorithm log_equalization, got"):
        resolve_recipe({"s": {"LogarithmicEqualizationModifier": {"algorithm": "smoothquant"}}})


def test_llmcompressor_s_saved_spinquant_and_moe_awq_arguments_are_read():
    """Found by a tester (session 26): a saved SpinQuant recipe (``precision: torch.float64``, the resolved
    ``transform_config``) and a saved MoE AWQ recipe (``offload_device: !!python/object/apply:torch.device [cpu]``)
    were refused. The torch.device tag reads as its string; the transform_config llm-compressor resolves from the
    other arguments is accepted, one that says something else is refused; other Python object tags stay refused."""
    pytest.importorskip("llmc_fsm_quantization", reason="the llmc-fsm-quantization plugin is not installed")
    r1 = ("{type: hadamard, randomize: false, requires_grad: false, head_dim: null, precision: torch.float64, apply: ["
          "{targets: ['re:.*embed_tokens$', 're:.*o_proj$', 're:.*down_proj$'], location: weight_output, "
          "inverse: false, ignore: []}, {targets: ['re:.*q_proj$', 're:.*k_proj$', 're:.*v_proj$', 're:.*up_proj$', "
          "'re:.*gate_proj$', lm_head], location: weight_input, inverse: true, ignore: []}]}")  # fmt: skip
    spin = f"""s_stage:
  quant_modifiers:
    SpinQuantModifier:
      requires_calibration_data: false
      rotations: [R1]
      transform_type: hadamard
      randomize: false
      learnable: false
      precision: torch.float64
      transform_config: {{config_groups: {{R1: {r1}}}}}
"""
    (mod,) = resolve_recipe(spin).modifiers
    assert (mod.precision, mod.rotations) == ("float64", ("R1",))
    with pytest.raises(RecipeError, match="transform_config is not supported .group R1 is not what llm-compressor"):
        resolve_recipe(spin.replace("location: weight_output", "location: weight_input"))
    awq = "s_stage:\n  quant_modifiers:\n    AWQModifier:\n      offload_device: "
    awq += "!!python/object/apply:torch.device [cpu]\n"
    (mod,) = resolve_recipe(awq).modifiers
    assert mod.offload_device == "cpu"
    (mod,) = resolve_recipe(awq.replace("!!python/object/apply:torch.device [cpu]", "cuda:0")).modifiers
    assert mod.offload_device == "cuda:0"  # a device index, as llm-compressor takes it (refused before)
    with pytest.raises(RecipeError, match="could not determine a constructor for the tag"):
        resolve_recipe(awq.replace("torch.device", "compressed_tensors.utils.helpers.anything"))


def test_llmcompressor_s_sentinel_reads_as_the_argument_left_out():
    """Found by a tester (session 39): the recipe.yaml llm-compressor writes for an AWQModifier it has not
    initialized (``Recipe.from_modifiers(...).yaml()``) holds ``offload_device: !!python/object/apply:
    llmcompressor.sentinel.Sentinel [not_provided, <its path>]``, and was refused ("could not determine a
    constructor"). The sentinel is its "not given": the key is left out (our default); other tags stay refused."""
    pytest.importorskip("llmc_fsm_quantization", reason="the llmc-fsm-quantization plugin is not installed")
    head = "s_stage:\n  quant_modifiers:\n    AWQModifier:\n      duo_scaling: false\n      offload_device: "
    sentinel = "!!python/object/apply:llmcompressor.sentinel.Sentinel [not_provided,\n"
    sentinel += "        /x/llmcompressor/sentinel.py]"
    (mod,) = resolve_recipe(head + sentinel + "\n      n_grid: 10\n").modifiers
    assert (mod.offload_device, mod.duo_scaling, mod.n_grid) == (None, False, 10)
    with pytest.raises(RecipeError, match="could not determine a constructor for the tag .*sentinel.Sentinelx"):
        resolve_recipe(head + sentinel.replace("Sentinel [", "Sentinelx ["))
    with pytest.raises(RecipeError, match="could not determine a constructor for the tag .*sentinel.Sentinel "):
        resolve_recipe(head + "!!python/object/apply:llmcompressor.sentinel.Sentinel [3]\n")


def test_awq_modifier_holds_its_mappings_as_awq_mapping_objects_and_saves_the_dict_form():
    """Found by a tester (session 39): ``AWQModifier(mappings=[AWQMapping(...)]).mappings`` held dicts, so a script
    reading ``.mappings[0].smooth_layer`` back (as llm-compressor's pydantic field allows, dicts given or objects)
    failed. Both forms are now held as AWQMapping objects; the recipe and the resume fingerprint keep the dict form."""
    why = "the llmc-fsm-quantization plugin is not installed"
    quantization = pytest.importorskip("llmc_fsm_quantization", reason=why)
    awq = [{"smooth_layer": "re:.*input_layernorm$", "balance_layers": ["re:.*q_proj$", "re:.*k_proj$"]},
           {"smooth_layer": "re:.*post_attention_layernorm$", "balance_layers": ["re:.*up_proj$"]}]  # fmt: skip
    objects = [quantization.AWQMapping(m["smooth_layer"], m["balance_layers"]) for m in awq]
    for modifier in (quantization.AWQModifier(mappings=awq), quantization.AWQModifier(mappings=objects)):
        assert modifier.mappings == objects
        assert [(m.smooth_layer, m.balance_layers) for m in modifier.mappings] == [
            ("re:.*input_layernorm$", ("re:.*q_proj$", "re:.*k_proj$")),
            ("re:.*post_attention_layernorm$", ("re:.*up_proj$",)),
        ]
        recipe = resolve_recipe([modifier])
        (stage,) = recipe.to_dict().values()
        assert stage["modifiers"][0]["AWQModifier"]["mappings"] == awq
        (printed,) = recipe_fingerprint(["a"], [modifier], recipe.plan())
        assert printed["arguments"]["mappings"] == awq
    assert quantization.AWQModifier().mappings is None


def test_quantization_modifier_recipe_with_weight_observer():
    pytest.importorskip("llmc_fsm_quantization", reason="the llmc-fsm-quantization plugin is not installed")
    recipe = """
quant_modifiers:
  QuantizationModifier:
    targets: Linear
    ignore: [lm_head]
    scheme: W8A8
    weight_observer: mse
    kv_cache_scheme: null
    bypass_divisibility_checks: false
"""
    recipe_obj = resolve_recipe(recipe)
    assert [s.name for s in recipe_obj.stages] == ["default"]  # top-level groups: one default stage
    (mod,) = recipe_obj.modifiers
    assert (mod.scheme, mod.observer) == ("W8A8", "mse")
    model = llama(tied=True)
    before = model.model.layers[0].mlp.down_proj.weight.clone()
    native = {"q": {"QuantizationModifier": {"scheme": "W8A8", "observer": "mse"}}}
    theirs = oneshot(recipe, copy.deepcopy(model))
    same_weights(theirs, oneshot(native, model))
    assert not torch.equal(theirs.model.layers[0].mlp.down_proj.weight, before)  # it did quantize


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "GPTQModifier: {scheme: W8A8, kv_cache_scheme: {num_bits: 8}}",
            "argument 'kv_cache_scheme': kv_cache_scheme: only an FP8 KV cache is supported (num_bits 8, type float; "
            "vLLM's KV-cache format), got num_bits 8, type int; use {num_bits: 8, type: float, symmetric: true, "
            "dynamic: false, strategy: tensor (or attn_head)}",
        ),
        (
            "QuantizationModifier: {input_observer: static_minmax}",
            "argument 'input_observer': input_observer applies to static input activations (dynamic: false) or "
            "NVFP4's (dynamic: local), and no config group has them",
        ),
        (
            "QuantizationModifier: {weight_observer: mse, observer: minmax}",
            "argument 'weight_observer': it sets 'observer' to 'mse', but 'observer' is also given",
        ),
        (
            "QuantizationModifier: {weight_observer: best}",
            "argument 'observer' (given as 'weight_observer'): unknown observer 'best'; choose one of "
            "minmax, static_minmax, memoryless_minmax, mse, memoryless_mse, imatrix_mse, nvfp4_expanded_mse",
        ),
        (
            "GPTQModifier: {targets: [re:.*mlp.*], "
            "config_groups: {g: {targets: [re:.*proj$], weights: {num_bits: 8}}}}",
            "argument 'targets': the modifier's targets ['re:.*mlp.*'] differ from its config_groups' targets "
            "['re:.*proj$']: leave targets out (each config group names its own)",
        ),
        (  # several presets are config groups (llm-compressor's group_0, group_1); one target in both is refused
            "GPTQModifier: {scheme: {W8A8: [Linear], W4A16: [Linear]}}",
            "argument 'config_groups' (given as 'scheme'): config_groups entries 'group_0' and 'group_1' both give "
            "target 'Linear'; a module is quantized with one scheme (llm-compressor takes the last entry's): keep the "
            "target in one entry",
        ),
        (  # with targets beside it a TypeError escaped as a traceback (a fuzzing tester's case)
            "GPTQModifier: {scheme: {W4A16: null}, targets: [Linear]}",
            "argument 'scheme': the targets of preset 'W4A16' must be a module pattern or a list of them, got None",
        ),
        (
            "QuantizationModifier: {observer: {weights: mse, output: minmax}}",
            "argument 'observer': only the weight and input observers can be chosen ({weights: NAME, input: NAME}), "
            "got {'weights': 'mse', 'output': 'minmax'}",
        ),
    ],
)
def test_quantization_argument_refusals(body: str, message: str):
    pytest.importorskip("llmc_fsm_quantization", reason="the llmc-fsm-quantization plugin is not installed")
    with pytest.raises(RecipeError) as info:
        resolve_recipe(f"s:\n  q_modifiers:\n    {body}\n")
    modifier = body.split(":")[0]
    assert str(info.value) == f"recipe <text>, line 3, stage 's', modifier {modifier}, {message}"


def test_quantization_value_forms_of_llmcompressor():
    pytest.importorskip("llmc_fsm_quantization", reason="the llmc-fsm-quantization plugin is not installed")
    recipe = resolve_recipe(
        "s:\n  q_modifiers:\n    QuantizationModifier:\n      scheme: {W8A8: [re:.*proj$]}\n"
        "      observer: {weights: mse}\n"
    )
    (mod,) = recipe.modifiers
    assert (mod.scheme, list(mod.targets), mod.observer) == ("W8A8", ["re:.*proj$"], "mse")
    assert mod.quantization_scheme.targets == ["re:.*proj$"]
    # plain values are passed on as they are
    (mod,) = resolve_recipe("s:\n  QuantizationModifier: {scheme: W4A16, observer: minmax}\n").modifiers
    assert (mod.scheme, mod.observer) == ("W4A16", "minmax")


# --- nesting and refusals (no model) --------------------------------------------------------------------------


def test_groups_stages_wrapper_metadata_and_run_type_round_trip():
    text = """
version: 1.1.0
metadata: {author: someone}
stages:
  first_stage:
    run_type: oneshot
    a_modifiers:
      WandaPruningModifier: {sparsity: 0.2}
    b_modifiers:
      - ConstantPruningModifier
    modifiers:
      MagnitudePruningModifier: {sparsity: 0.3}
"""
    recipe = resolve_recipe(text)
    (stage,) = recipe.stages
    assert (stage.name, stage.run_type) == ("first_stage", "oneshot")
    assert [m.modifier_name() for m in stage.modifiers] == [
        "WandaPruningModifier",
        "ConstantPruningModifier",
        "MagnitudePruningModifier",
    ]
    again = resolve_recipe(recipe.to_yaml(applied=True))
    assert [(s.name, s.run_type, s.applied) for s in again.stages] == [("first_stage", "oneshot", True)]
    # top-level groups and a stage: the groups become the stage 'default', where the first group was
    recipe = resolve_recipe(
        "p_modifiers:\n  WandaPruningModifier: {}\nlater:\n  ConstantPruningModifier:\n"
        "q_modifiers:\n  MagnitudePruningModifier: {sparsity: 0.1}\n"
    )
    assert [(s.name, [m.modifier_name() for m in s.modifiers]) for s in recipe.stages] == [
        ("default", ["WandaPruningModifier", "MagnitudePruningModifier"]),
        ("later", ["ConstantPruningModifier"]),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "s:\n  run_type: finetune\n  p_modifiers: {ConstantPruningModifier: {}}\n",
            "recipe <text>, line 2, stage 's': run_type must be oneshot or post_train or train (as in llm-compressor), "
            "got 'finetune'",
        ),
        (
            "s:\n  p_modifiers:\n    SparseGPTModifier: {sparsity_profile: owl, owl_m: 5, owl_lmbda: 0.08}\n",
            "recipe <text> has 3 problems; fix them all, then run it again:\n"
            + "".join(
                f"  - line 3, stage 's', modifier SparseGPTModifier, argument {arg!r}: llm-compressor argument "
                f"accepted only as None, got {value}: OWL layer-wise sparsity is not implemented (null, "
                f"llm-compressor's default, is off); give one sparsity for every layer{end}"
                for arg, value, end in (("sparsity_profile", "'owl'", "\n"), ("owl_m", "5", "\n"),
                                        ("owl_lmbda", "0.08", ""))
            ),
        ),
        (
            "s:\n  p_modifiers:\n    MagnitudePruningModifier: {sparsity: 0.5, update_scheduler: linear}\n",
            "recipe <text>, line 3, stage 's', modifier MagnitudePruningModifier, argument 'update_scheduler': "
            "llm-compressor argument accepted only as 'cubic', got 'linear': only 'cubic', the schedule llmc-fsm uses",
        ),
        (
            "s:\n  p_modifiers:\n    WandaPruningModifier: {sparsity: [0.5, 0.4]}\n",
            "recipe <text>, line 3, stage 's', modifier WandaPruningModifier, argument 'sparsity': sparsity "
            "[0.5, 0.4]: llm-compressor's per-layer form (a list matched to the targets, or a mapping) is not "
            "supported here; give one number in [0, 1) per modifier, and for several sparsities one modifier per "
            "sparsity with the layers it prunes as its targets (a stage in list form may hold the same modifier several times: - "
            "WandaPruningModifier: {sparsity: 0.3, targets: [...]})",
        ),
        (
            "s:\n  p_modifiers:\n    WandaPruningModifier: {quantize: false}\n",
            "recipe <text>, line 3, stage 's', modifier WandaPruningModifier: unknown argument 'quantize'.",
        ),
        (
            "default:\n  WandaPruningModifier: {}\np_modifiers:\n  WandaPruningModifier: {}\n",
            "recipe <text>: top-level '<group>_modifiers' keys form the stage 'default', and the recipe also has a "
            "stage named 'default'; rename that stage",
        ),
        (
            "s:\n  run_type: oneshot\n",
            "recipe <text>, line 1, stage 's': a stage with 'run_type' must list its "
            "modifiers under 'modifiers:' or llm-compressor groups such as 'pruning_modifiers:'",
        ),
        ("s:\n  run_type: oneshot\n  p_modifiers:\n", "recipe <text>, line 3, stage 's': the stage has no modifiers"),
        ("version: 1.0\n", "recipe <text> has no stages (only metadata)"),
    ],
)
def test_llmcompressor_shapes_refused_with_a_reason(text: str, message: str):
    with pytest.raises(RecipeError) as info:
        resolve_recipe(text)
    assert str(info.value).startswith(message)


def test_older_llm_compressor_argument_names_and_run_types_are_read() -> None:
    from llmc_fsm.recipes.building import resolve_recipe

    recipe = resolve_recipe(
        "s:\n  run_type: post_train\n  quant_modifiers:\n"
        "    GPTQModifier: {percdamp: 0.05, sequential_update: true, scheme: W8A16}\n"
        "    QuantizationModifier: {sequential_update: false, scheme: W8A8, targets: [lm_head], ignore: []}\n"
    )
    gptq, rtn = recipe.stages[0].modifiers
    assert recipe.stages[0].run_type == "post_train"
    assert gptq.dampening_frac == 0.05 and rtn.targets == ["lm_head"]


def test_modifier_objects_take_llmcompressor_names_as_recipe_text_does(caplog):
    # the same translation as the recipe text above, for a modifier built in Python (llm-compressor's scripts)
    from llmc_fsm_quantization import GPTQModifier, QuantizationModifier

    text = resolve_recipe("s:\n  GPTQModifier: {percdamp: 0.05, offload_hessians: true, scheme: {W8A16: [Linear]}}\n")
    caplog.clear()  # the recipe text's warning: the same line as the object's below
    with caplog.at_level("INFO", logger="llmc_fsm.recipes.llmcompressor"):
        gptq = GPTQModifier(percdamp=0.05, offload_hessians=True, scheme={"W8A16": ["Linear"]})
    expected = text.stages[0].modifiers[0]
    assert (gptq.dampening_frac, gptq.scheme, list(gptq.targets)) == (0.05, "W8A16", ["Linear"])
    assert (gptq.dampening_frac, gptq.scheme, list(gptq.targets)) == (
        expected.dampening_frac, expected.scheme, list(expected.targets)
    )
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "GPTQModifier: llm-compressor argument 'offload_hessians'=True accepted and ignored: memory "
         "placement only; llmc-fsm keeps only the current layer's statistics")
    ]  # fmt: skip
    assert QuantizationModifier(scheme="W4A16", observer={"weights": "mse"}).observer == "mse"
    assert QuantizationModifier(scheme="W4A16", weight_observer="mse").observer == "mse"
    with pytest.raises(ValueError, match=r"^GPTQModifier: argument 'percdamp' sets 'dampening_frac' to 0.05, but "):
        GPTQModifier(scheme="W4A16", percdamp=0.05, dampening_frac=0.1)
    with pytest.raises(ValueError, match=r"^GPTQModifier: argument 'sequential_targets': llm-compressor argument "
                       r"not supported: the pipeline finds the decoder layers from the model; remove it$"):
        GPTQModifier(scheme="W4A16", sequential_targets=["LlamaDecoderLayer"])
    with pytest.raises(TypeError, match=r"^GPTQModifier\(\) got an unexpected keyword argument 'dampening_fraction' "
                       r"\(did you mean 'dampening_frac'\?\)$"):  # a typo stays a typo, with the closest name
        GPTQModifier(scheme="W4A16", dampening_fraction=0.1)
    # llm-compressor's str targets beside the {PRESET: targets} form; a plugin's subclass keeps its base's rules
    assert list(GPTQModifier(scheme={"W4A16": "Linear"}, targets="Linear").targets) == ["Linear"]
    import attrs

    @attrs.define(kw_only=True, slots=False, eq=False)
    class PluginGPTQ(GPTQModifier):
        extra: int = 1

    assert PluginGPTQ(scheme="W4A16", percdamp=0.03).dampening_frac == 0.03


THREE_PROBLEMS = """\
prune_stage:
  pruning_modifiers:
    SparseGPTModifier:
      sparsity: "half"
      mask_structure: "2:4"
quant_stage:
  quantization_modifiers:
    GPTQModifier:
      scheme: W4A16
      dampening: 0.01
      actorder: sideways
"""


def three_problems(source: str) -> str:
    return (
        f"recipe {source} has 3 problems; fix them all, then run it again:\n"
        "  - line 4, stage 'prune_stage', modifier SparseGPTModifier, argument 'sparsity': sparsity must be a number "
        "in [0, 1) (fraction of weights set to zero), got 'half'\n"
        "  - line 10, stage 'quant_stage', modifier GPTQModifier: unknown argument 'dampening'. Did you mean "
        "'dampening_frac'? GPTQModifier accepts: start, end, update, targets, scheme, config_groups, observer, "
        "input_observer, ignore, kv_cache_scheme, calibrate_all_experts, block_size, dampening_frac, actorder\n"
        "  - line 11, stage 'quant_stage', modifier GPTQModifier, argument 'actorder': actorder must be one of static "
        "(alias weight) or null, got 'sideways'"
    )


def test_a_recipe_with_three_problems_in_two_modifiers_gets_one_error_naming_all_three() -> None:
    # a wrong type, an unknown name and an unsupported value: one run finds all of them
    with pytest.raises(RecipeError) as info:
        resolve_recipe(THREE_PROBLEMS)
    assert str(info.value) == three_problems("<text>")
    assert len(info.value.problems) == 3


def test_oneshot_cli_lists_every_problem_before_the_model_loads(tmp_path, capsys, monkeypatch) -> None:
    from llmc_fsm.cli import main
    from llmc_fsm.models.known import known_model_dir
    from llmc_fsm.oneshot_job import phases

    def no_load(*args: object, **kw: object) -> None:
        raise AssertionError("the model was loaded before the recipe was checked")

    monkeypatch.setattr(phases, "load_model", no_load)
    path = tmp_path / "recipe.yaml"
    path.write_text(THREE_PROBLEMS)
    argv = ["oneshot", "--model", str(known_model_dir("smollm2-135m")), "--recipe", str(path)]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"llmc-fsm oneshot: error: {three_problems(str(path))}\n"
    assert not (tmp_path / "out").exists()


def test_bad_stage_keys_are_listed_with_the_modifiers_problems() -> None:
    # the stage's own keys do not hide its modifiers' problems (the stage is read on without the bad values)
    with pytest.raises(RecipeError) as info:
        resolve_recipe(
            "s:\n  run_type: finetune\n  start: -1\n  p_modifiers:\n    WandaPruningModifier: {sparsity: 2}\n"
        )
    assert str(info.value).splitlines() == [
        "recipe <text> has 3 problems; fix them all, then run it again:",
        "  - line 2, stage 's': run_type must be oneshot or post_train or train (as in llm-compressor), got 'finetune'",
        "  - line 3, stage 's': start must be >= 0 epochs, got -1",
        "  - line 5, stage 's', modifier WandaPruningModifier, argument 'sparsity': sparsity must be a number in "
        "[0, 1) (fraction of weights set to zero), got 2",
    ]


def test_a_modifier_object_at_its_defaults_is_explained_as_the_same_recipe_text() -> None:
    """``GPTQModifier()``'s scheme, observer and ignore are filled in by its converters: compared with the raw
    attrs defaults (``None``) they were shown without "(default)" and without llm-compressor's notes."""
    from llmc_fsm_quantization import GPTQModifier

    from llmc_fsm import Session
    from llmc_fsm.session.explain import explain

    def arguments(session) -> str:
        return next(line for line in explain(session).splitlines() if line.strip().startswith("arguments:"))

    assert arguments(Session([GPTQModifier()])) == arguments(Session("s:\n  GPTQModifier: {}\n"))
    assert "scheme='W4A16' (default; llm-compressor has no default scheme" in arguments(Session([GPTQModifier()]))
    assert "scheme='W8A8'," in arguments(Session([GPTQModifier(scheme="W8A8")]))  # a value given: no mark


def test_two_stages_of_one_name_are_refused():
    """A ``stages:`` mapping and a top-level stage of the same name both ran, and the saved recipe (a mapping by
    stage name) kept one of them (a fuzzing tester's case); stage objects of one name likewise."""
    with pytest.raises(RecipeError) as info:
        resolve_recipe("stages:\n  prune_stage:\n    WandaPruningModifier: {sparsity: 0.5}\nprune_stage:\n"
                       "  WandaPruningModifier: {sparsity: 0.3}\n")  # fmt: skip
    assert str(info.value) == "recipe <text>: two stages are named 'prune_stage' (stage names are unique); rename one"
    with pytest.raises(RecipeError, match=r"^recipe <dict>: two stages are named 'a' \(stage names are unique\)"):
        resolve_recipe({"stages": {"a": {"WandaPruningModifier": {}}}, "a": {"ConstantPruningModifier": {}}})


def test_a_null_ignore_or_targets_is_refused_where_llm_compressor_refuses_it():
    """A blank ``ignore:`` (an entry commented out) meant [] to the pruners (lm_head pruned) and the default
    [lm_head] to the quantizers (a fuzzing tester's case); llm-compressor refuses null for both, except
    SmoothQuant's ignore (``list | None``), taken as []."""
    at = "recipe <text>, line 3, stage 's', modifier"
    for name, key, what in (
        ("WandaPruningModifier", "ignore", "give [] to compress every target (lm_head too), or leave ignore out for "
                                           "the modifier's default"),
        ("GPTQModifier", "ignore", "give [] to compress every target (lm_head too), or leave ignore out for the "
                                   "modifier's default"),
        ("GPTQModifier", "targets", "name the modules, or leave targets out for the modifier's default"),
    ):  # fmt: skip
        with pytest.raises(RecipeError) as info:
            resolve_recipe(f"s:\n  {name}:\n    {key}:\n")
        assert str(info.value) == (
            f"{at} {name}, argument {key!r}: null is not a list of module patterns (llm-compressor refuses it): {what}"
        )
    (smoothing,) = resolve_recipe("s:\n  SmoothQuantModifier:\n    ignore: null\n").modifiers
    assert smoothing.ignore == []


def test_a_stage_number_written_as_a_string_and_a_nul_in_a_recipe():
    """A fuzzing tester's nits: a stage's ``start: 1e-1`` (YAML 1.1 reads it as a string) was refused where a
    modifier's is read as 0.1; a NUL character gave PyYAML's two-line text naming "<unicode string>"."""
    body = "  run_type: train\n  pruning_modifiers:\n    ConstantPruningModifier: {}\n"
    (stage,) = resolve_recipe(f"s:\n  start: 1e-1\n  end: '2'\n{body}").stages
    assert (stage.start, stage.end) == (0.1, 2.0)
    with pytest.raises(RecipeError, match=r"^recipe <text>, line 2, stage 's': start must be a number of epochs or "
                                          r"null, got 'abc'$"):
        resolve_recipe(f"s:\n  start: abc\n{body}")
    with pytest.raises(RecipeError) as info:
        resolve_recipe("s:\n  GPTQModifier: {scheme: W4A16}\x00\n")
    assert str(info.value) == (
        "recipe <text>, line 2, column 32: not valid YAML/JSON: character U+0000 (special characters are not "
        "allowed); save the recipe as plain UTF-8 text"
    )


def test_a_mapping_as_targets_a_torch_device_as_offload_device_and_a_number_as_sequential_targets():
    """A fuzzing tester's nits: ``targets: {Linear: 1}`` was taken as its keys; AWQ's ``offload_device`` given as a
    torch.device (llm-compressor's declared type) was refused when the recipe was saved; ``sequential_targets=5``
    raised "'int' object is not iterable"."""
    with pytest.raises(RecipeError, match=r"argument 'targets': TypeError: must be a module pattern or a list of them "
                                          r"\(class name, full name or 're:<regex>'\), got \{'Linear': 1\}$"):
        resolve_recipe("s:\n  GPTQModifier: {targets: {Linear: 1}}\n")
    from llmc_fsm_quantization import AWQModifier

    from llmc_fsm.oneshot_job.settings import OneshotSettings

    recipe = Session([AWQModifier(offload_device=torch.device("cpu"))]).recipe
    assert "offload_device: cpu" in recipe.to_yaml()
    with pytest.raises(ValueError, match=r"^sequential_targets must be None or class names \(e.g. "
                                         r"\['LlamaDecoderLayer'\]\), got 5$"):
        OneshotSettings(sequential_targets=5)


def test_b5s_cases_on_the_null_and_pattern_rules():
    """B5's cases: ``ignore=None`` on a pruner object still pruned lm_head (only recipe text was refused); a set of
    targets kept the order of the string hash seed; the null refusal advised arguments a modifier lacks; AWQ's
    construction errors named QuantizationModifier."""
    from llmc_fsm_pruning import SparseGPTModifier
    from llmc_fsm_quantization import AWQModifier, GPTQModifier, QuantizationModifier, SmoothQuantModifier

    # the quantizers too (session 29's left item: their None meant the default [lm_head])
    for cls in (SparseGPTModifier, AWQModifier, QuantizationModifier, GPTQModifier):
        with pytest.raises(TypeError, match=r"^must be a module pattern or a list of them, got None: leave the "
                                            r"argument out for the modifier's default \(ignore=\[\] ignores nothing; "
                                            r"targets must name a module\)$"):
            cls(ignore=None)
    assert SmoothQuantModifier(ignore=None).ignore == []  # llm-compressor's list | None
    for given, defaulted in (({}, True), ({"ignore": ["lm_head"]}, False), ({"ignore": []}, False)):
        quantizer = GPTQModifier(scheme="W4A16", **given)
        assert (quantizer.ignore, quantizer._ignore_defaulted) == (given.get("ignore", ["lm_head"]), defaulted)
    names = {f"re:.*layers\\.{i}\\..*" for i in (9, 3, 7, 1, 8, 2, 6, 0)}
    assert SparseGPTModifier(ignore=names).ignore == sorted(names)
    with pytest.raises(RecipeError, match=r"modifier SpinQuantModifier: unknown argument 'targets'\."):
        resolve_recipe("s:\n  SpinQuantModifier:\n    targets:\n")
    with pytest.raises(RecipeError) as info:
        resolve_recipe("s:\n  AWQModifier: {scheme: {W4A16: [Linear], W8A16: [Linear]}}\n")
    assert str(info.value).endswith("modifier AWQModifier, argument 'scheme': config_groups entries 'group_0' and "
                                    "'group_1' both give target 'Linear'; a module is quantized with one scheme "
                                    "(llm-compressor takes the last entry's): keep the target in one entry")
    # B6's cases: a scheme two bits away is not "close" (INT4 is not INT8); numpy accumulation steps give an int
    with pytest.raises(RecipeError) as info:
        resolve_recipe("s:\n  GPTQModifier: {scheme: INT4}\n")
    assert "unknown quantization scheme 'INT4'; presets:" in str(info.value)
    import numpy as np

    from llmc_fsm.integrations.torch import resume_position

    position = resume_position(Session([SparseGPTModifier()]), np.int64(6), np.int64(2))
    assert position == (0, 0) and all(type(v) is int for v in position)


def test_llmcompressors_null_owl_arguments_are_its_default_and_taken():
    """``sparsity_profile: null``, ``owl_m: null``, ``owl_lmbda: null`` (OWL off, llm-compressor's defaults, as older
    recipes write them) were refused with "give one sparsity for every layer" on a recipe giving one (found by a
    README-only newcomer)."""
    owl = "sparsity_profile: null, owl_m: null, owl_lmbda: null"
    recipe = resolve_recipe(f"s:\n  p_modifiers:\n    SparseGPTModifier: {{sparsity: 0.5, {owl}}}\n")
    (modifier,) = recipe.stages[0].modifiers
    assert modifier.sparsity == 0.5
