"""Edges of KV-cache and attention quantization found by testers: a gated query projection (Qwen3-Next), an eager
attention implementation, and two modifiers giving different KV-cache schemes for the same attention modules."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from llmc_fsm_quantization import GPTQModifier, QuantizationModifier, kv_cache, load_kv_cache_scales
from safetensors import safe_open
from tiny_quant_models import tiny_llama

import llmc_fsm

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # tiny_families

KV = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}


def _data() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _attention_group(target: str, strategy: str) -> dict:
    args = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    return {"attention": {"targets": [target], "input_activations": args}}


def _eager_message(model_type: str, cls: str) -> str:
    return (
        f"{cls} (model_type '{model_type}'): attention quantization needs the model's attention implementation in "
        "transformers' ALL_ATTENTION_FUNCTIONS, and it is 'eager', which is not there (compressed-tensors' hooked "
        "attention calls the original implementation through it: the calibration forward would fail with KeyError "
        "'eager'); load the model with attn_implementation='sdpa' where its family allows it (from_pretrained(..., "
        "attn_implementation='sdpa'), then pass the model), or quantize the KV cache alone (kv_cache_scheme), which "
        "works with it"
    )


def test_per_head_query_scales_of_a_gated_attention_take_the_configs_number_of_heads(tmp_path) -> None:
    """Qwen3-Next's q_proj gives the queries and the output gate (2 x 4 heads x head_dim 16 = 128 wide): found by a
    tester, the query heads were taken as 128 / 16 = 8 and the run failed at its end on reshaping 4 head ranges to
    [8, 1, 1]; a checkpoint with q_scale [4, 1, 1] (llm-compressor 0.14's) was refused on reload."""
    from tiny_families import build

    model = build("qwen3_next")
    attention = model.model.layers[1].self_attn
    assert attention.q_proj.out_features == 2 * 4 * 16 and model.config.num_attention_heads == 4
    assert kv_cache.query_heads(attention) == 4 and kv_cache.kv_heads(attention) == 2
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    groups = {**_attention_group("Qwen3NextAttention", "attn_head"), "w": {"targets": ["Linear"], "weights": weights}}
    recipe = {"q": {"QuantizationModifier": {"config_groups": groups, "ignore": ["lm_head"]}}}
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), batch_size=1, output_dir=out, progress=False)
    assert tuple(attention.q_scale.shape) == (4, 1, 1) and bool(torch.isfinite(attention.q_scale).all())
    assert tuple(attention.k_scale.shape) == (2, 1, 1)
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert tuple(fh.get_tensor("model.layers.1.self_attn.q_scale").shape) == (4, 1, 1)
    reloaded = build("qwen3_next")
    assert load_kv_cache_scales(reloaded, out) == 1
    assert torch.equal(reloaded.model.layers[1].self_attn.q_scale, attention.q_scale)


def test_attention_quantization_on_an_eager_model_is_refused_before_any_work_and_the_kv_cache_alone_runs() -> None:
    """Found by a tester: on an eager model (Gemma2 under transformers 5.25, GPT-OSS) the run died with a bare
    KeyError: 'eager' from compressed-tensors' hooked attention after the modules were hooked."""
    model = tiny_llama()
    model.set_attn_implementation("eager")
    before = copy.deepcopy(model.state_dict())
    recipe = {"q": {"QuantizationModifier": {"config_groups": _attention_group("LlamaAttention", "tensor")}}}
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), progress=False)
    assert str(err.value) == "QuantizationModifier: " + _eager_message("llama", "LlamaForCausalLM")
    assert model.config._attn_implementation == "eager"
    assert not any(hasattr(m, "q_scale") or hasattr(m, "k_scale") for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    llmc_fsm.oneshot(model=model, recipe={"q": {"QuantizationModifier": {"kv_cache_scheme": KV}}}, dataset=_data(),
                     progress=False)
    assert bool(torch.isfinite(model.model.layers[0].self_attn.k_scale).all())


def test_reloading_attention_quantization_onto_an_eager_model_is_refused_and_leaves_it_as_it_was(tmp_path) -> None:
    """Found by a tester: load_kv_cache_scales hooked an eager model's attention, whose next forward then failed
    with KeyError: 'eager'."""
    from transformers import AutoModelForCausalLM

    recipe = {"q": {"QuantizationModifier": {"config_groups": _attention_group("LlamaAttention", "tensor")}}}
    out = tmp_path / "out"
    llmc_fsm.oneshot(model=tiny_llama(), recipe=recipe, dataset=_data(), output_dir=out, progress=False)
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with pytest.raises(ValueError) as err:
        load_kv_cache_scales(reloaded, out)
    assert str(err.value) == f"{out}: " + _eager_message("llama", "LlamaForCausalLM")
    assert reloaded.config._attn_implementation == "eager"
    assert not any(hasattr(m, "q_scale") or hasattr(m, "k_scale") for m in reloaded.modules())
    with torch.no_grad():
        reloaded(_data())  # still runs


def test_two_modifiers_of_a_stage_with_different_kv_cache_schemes_are_refused_before_any_work() -> None:
    """Found by a tester: different strategies failed on the scales' shape after the work; a different observer
    was dropped without a word."""
    for second, scheme in (({**KV, "strategy": "attn_head"}, "attn_head, observer: minmax"),
                           ({**KV, "observer": "static_minmax"}, "tensor, observer: static_minmax")):
        model = tiny_llama()
        before = copy.deepcopy(model.state_dict())
        recipe = {"q": {
            "QuantizationModifier": {"targets": ["re:.*mlp.*"], "scheme": "FP8_DYNAMIC", "kv_cache_scheme": KV},
            "GPTQModifier": {"targets": ["re:.*self_attn.*"], "scheme": "W8A8", "kv_cache_scheme": second},
        }}
        with pytest.raises(ValueError) as err:
            llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), progress=False)
        assert str(err.value) == (
            "QuantizationModifier and GPTQModifier both quantize the KV cache of model.layers.0.self_attn, with "
            "kv_cache_scheme {strategy: tensor, observer: minmax} and kv_cache_scheme {strategy: " + scheme + "}: an "
            "attention's KV cache is quantized once; give the scheme in one of them (or the same in both)"
        )
        assert not any(hasattr(m, "k_scale") for m in model.modules())
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_same_kv_cache_scheme_in_two_modifiers_of_a_stage_runs() -> None:
    model = tiny_llama()
    recipe = {"q": {
        "QuantizationModifier": {"targets": ["re:.*mlp.*"], "scheme": "FP8_DYNAMIC", "kv_cache_scheme": KV},
        "GPTQModifier": {"targets": ["re:.*self_attn.*"], "scheme": "W8A8", "kv_cache_scheme": KV},
    }}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), progress=False)
    assert tuple(model.model.layers[0].self_attn.k_scale.shape) == (1,)
    assert bool(torch.isfinite(model.model.layers[0].self_attn.k_scale).all())


def test_check_recipe_names_both_modifiers_of_two_stages_and_both_schemes() -> None:
    """The recipe-wide form (labels with their stages) of the check: a modifier of a later stage with a different
    scheme (found by a tester: the first stage's silently won while recipe.yaml said the later one was applied)."""
    model = tiny_llama()
    first = QuantizationModifier(kv_cache_scheme=KV)
    second = GPTQModifier(scheme="W8A8", kv_cache_scheme={**KV, "strategy": "attn_head", "observer": "static_minmax"})
    attention_only = QuantizationModifier(config_groups=_attention_group("LlamaAttention", "tensor"))
    for modifier in (first, second, attention_only):
        modifier.check_model(model)
    first.check_recipe(model, [("QuantizationModifier of stage 'a'", first), ("QuantizationModifier of stage 'c'",
                                                                            QuantizationModifier(kv_cache_scheme=KV))])
    with pytest.raises(ValueError) as err:
        first.check_recipe(model, [("QuantizationModifier of stage 'a'", first), ("GPTQModifier of stage 'b'", second)])
    assert str(err.value) == (
        "QuantizationModifier of stage 'a' and GPTQModifier of stage 'b' both quantize the KV cache of "
        "model.layers.0.self_attn, with kv_cache_scheme {strategy: tensor, observer: minmax} and kv_cache_scheme "
        "{strategy: attn_head, observer: static_minmax}: an attention's KV cache is quantized once; give the scheme "
        "in one of them (or the same in both)"
    )
    with pytest.raises(ValueError) as err:
        first.check_recipe(model, [("A", first), ("B", attention_only)])
    assert str(err.value) == (
        "A and B both quantize the KV cache of model.layers.0.self_attn, with kv_cache_scheme {strategy: tensor, "
        "observer: minmax} and attention quantization {strategy: tensor, observer: minmax}: an attention's KV cache is "
        "quantized once; attention quantization quantizes the attention's keys and values too: leave kv_cache_scheme "
        "out of the recipe"
    )  # the same arguments: "give the same in both" could not help (found by a tester)


def test_a_later_stage_with_a_different_kv_cache_scheme_is_refused_rather_than_dropped() -> None:
    """Two stages (found by a tester): the first stage's scheme silently won (k_scale [1], config tensor/minmax) while
    recipe.yaml said the second's (attn_head, static_minmax) was applied. Now refused before any work, naming both
    modifiers and both schemes; the model is left as it was."""
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = {
        "a": {"QuantizationModifier": {"kv_cache_scheme": KV}},
        "b": {"GPTQModifier": {"scheme": "W8A8", "ignore": ["lm_head"],
                               "kv_cache_scheme": {**KV, "strategy": "attn_head", "observer": "static_minmax"}}},
    }
    with pytest.raises(ValueError) as err:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), progress=False)
    assert str(err.value) == (
        "QuantizationModifier of stage 'a' and GPTQModifier of stage 'b' both quantize the KV cache of "
        "model.layers.0.self_attn, with kv_cache_scheme {strategy: tensor, observer: minmax} and kv_cache_scheme "
        "{strategy: attn_head, observer: static_minmax}: an attention's KV cache is quantized once; give the scheme "
        "in one of them (or the same in both)"
    )
    assert getattr(model.model.layers[0].self_attn, "k_scale", None) is None
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_a_second_run_on_the_same_model_with_another_kv_scheme_says_the_model_holds_scales_already() -> None:
    """Found by a tester: a second oneshot on the in-memory model of a first one, with another KV-cache scheme, was
    refused when calibration started with "give kv_cache_scheme ... once in the recipe", which the user had done;
    the message now says the model holds KV-cache scales already. Its weights are left as they were."""
    model = tiny_llama()
    llmc_fsm.oneshot(model=model, recipe={"a": {"QuantizationModifier": {"kv_cache_scheme": KV}}}, dataset=_data(),
                     progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = {"b": {"QuantizationModifier": {"kv_cache_scheme": {**KV, "strategy": "attn_head"}}}}
    with pytest.raises(Exception) as err:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_data(), progress=False)
    cause = err.value if isinstance(err.value, ValueError) else err.value.__cause__
    assert str(cause) == (
        "LlamaAttention: its KV cache is quantized already with {strategy: tensor, observer: minmax}, and another "
        "modifier gives {strategy: attn_head, observer: minmax}: an attention's KV cache is quantized once; the model "
        "holds KV-cache scales already (from an earlier run on this model object, or load_kv_cache_scales; two "
        "modifiers of one recipe are refused before any work): start again from the original model, or give the "
        "same scheme"
    )
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
