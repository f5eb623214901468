"""GPTQ ``actorder: group`` is refused, for reasons measured here on compressed-tensors 0.20 and transformers 5.24.

``group`` (alias ``dynamic``) means: groups formed of columns in activation order, so a column's group is not the
one of its position, and the checkpoint stores that mapping as ``weight_g_idx``. compressed-tensors 0.20 removed
it: its ``QuantizationArgs`` refuses the value, it registers no ``weight_g_idx`` even when the value is forced in,
a saved ``config.json`` naming it does not load, and a ``weight_g_idx`` tensor in the checkpoint is an unexpected
key that transformers drops (the reloaded model computes as if it were not there). These tests pin each fact, so
they fail the day a new compressed-tensors brings ``g_idx`` back and the refusal should be lifted.

What llmc-fsm runs instead is ``static`` (alias ``weight``): columns swept in activation order, each keeping the
group, scale and zero point of its own position (nothing to store).
"""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization
from llmc_fsm_quantization import GPTQModifier
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

import llmc_fsm
from llmc_fsm import RecipeError

REFUSAL = (
    "actorder: group needs a per-column group index (g_idx) in the checkpoint, which compressed-tensors 0.20 has "
    "removed (its QuantizationArgs refuses actorder 'group' and no weight_g_idx is saved or applied on reload; "
    "llm-compressor 0.14's GPTQ refuses it too); use static (the default, alias weight: columns in activation "
    "order, each keeping the group of its original position) or null"
)


def _tiny() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("value", ["group", "dynamic", ActivationOrdering.GROUP, ActivationOrdering.DYNAMIC])
def test_gptq_modifier_refuses_actorder_group_and_its_alias(value) -> None:
    with pytest.raises(ValueError) as info:
        GPTQModifier(actorder=value)
    assert str(info.value) == REFUSAL


def test_recipes_with_actorder_group_are_refused_when_read() -> None:
    with pytest.raises(RecipeError) as info:
        llmc_fsm.Session({"q": {"GPTQModifier": {"scheme": "W4A16", "actorder": "group"}}})
    assert str(info.value) == f"recipe <dict>, stage 'q', modifier GPTQModifier, argument 'actorder': {REFUSAL}"
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16,
               "actorder": "group"}
    with pytest.raises(RecipeError) as info:
        llmc_fsm.Session({"q": {"GPTQModifier": {"config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}}})
    assert str(info.value).endswith(
        "config_groups entry 'g': invalid quantization scheme {'weights': {'num_bits': 4, 'type': 'int', "
        "'symmetric': True, 'strategy': 'group', 'group_size': 16, 'actorder': 'group'}}: weights.actorder: "
        "actorder='group' has been removed. Consider using actorder='weight' or actorder=None instead"
    )


def test_compressed_tensors_0_20_has_no_actorder_group_and_no_weight_g_idx() -> None:
    for value, text in (("group", "actorder='group' has been removed"), (True, "which has been removed")):
        with pytest.raises(ValidationError, match=text):
            QuantizationArgs(num_bits=4, strategy="group", group_size=16, actorder=value)
    args = QuantizationArgs(num_bits=4, strategy="group", group_size=16, actorder="weight")
    args.actorder = ActivationOrdering.GROUP  # forced in: pydantic does not validate assignments here
    linear = torch.nn.Linear(32, 8)
    initialize_module_for_quantization(linear, QuantizationScheme(targets=["Linear"], weights=args),
                                       force_zero_point=True)
    assert sorted(name for name, _ in linear.named_parameters()) == [
        "bias", "weight", "weight_scale", "weight_zero_point"]


def test_transformers_drops_a_saved_weight_g_idx_and_refuses_a_config_with_actorder_group(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model = _tiny()
    recipe = {"q": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}, "block_size": 64}}}
    data = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=tmp_path, progress=False)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight_g_idx"
    tensors[key] = (torch.randperm(128, generator=torch.Generator().manual_seed(1)) // 16).to(torch.int32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["unexpected_keys"] == {key} and not info["missing_keys"] and not info["mismatched_keys"]
    assert not hasattr(reloaded.model.layers[0].mlp.down_proj, "weight_g_idx")
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the permuted grouping is not applied: the logits are those of the model without it
        assert torch.equal(model(x).logits, reloaded.eval()(x).logits)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValidationError, match=r"actorder='group' has been removed"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
