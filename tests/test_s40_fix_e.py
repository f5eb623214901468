"""Session 40, fixes E: RWKV calibrates (or is refused before any work), an ``ignore: [lm_head, head]`` on RWKV says
nothing, ``explain --fuse-stages`` says the stages share one pass (all found by testers)."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_families import build_rwkv

import llmc_fsm
from llmc_fsm import Session
from llmc_fsm.models.layers import UnsupportedArchitectureError
from llmc_fsm.pipeline.forward import capture_layer_inputs
from llmc_fsm.pipeline.layer import propagate
from llmc_fsm.session.explain import explain
from llmc_fsm.toolkit.targets import resolve_targets

SPARSEGPT = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "targets": ["Linear"], "ignore": ["head"]}}}
RESCALING = (
    "RwkvForCausalLM (model_type 'rwkv') rescales its blocks in inference (rescale_every=2 in its config, 4 layers): "
    "its forward halves the hidden states every 2 blocks and divides the later blocks' output weights by powers of 2 "
    "in place, which the sequential pipeline (each block given the previous block's output) would miss and then save: "
    "not supported; set rescale_every to 0 in the model's config.json (outside float16 the model then computes the "
    "same up to LayerNorm's epsilon)"
)


def _tokens(rows: int) -> torch.Tensor:
    return torch.randint(3, 120, (rows, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_rwkv_block_inputs_equal_a_plain_forwards_at_any_batch_size(rows):
    """RwkvBlock returns ``(hidden, state, attentions)`` with no return annotation: the capture stub returned a bare
    tensor, which RwkvModel.forward unpacks, so the capture crashed ("not enough values to unpack (expected 3, got
    1)" at batch size 1, "too many values to unpack" at 3...). Now each block's inputs, the pipeline's (captured, then
    propagated block by block), equal bitwise those a plain forward with the model's recurrent state gives it."""
    model = build_rwkv(layers=3)
    data = _tokens(rows)
    seen: dict[int, torch.Tensor] = {}
    handles = [
        block.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0].clone()))
        for i, block in enumerate(model.rwkv.blocks)
    ]
    with torch.no_grad():
        model(data, use_cache=True)  # the recurrent state passed from block to block
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        inputs = capture_layer_inputs(model, model.rwkv.blocks[0], [{"input_ids": data}])
        for index, block in enumerate(model.rwkv.blocks):
            assert torch.equal(inputs[0][0][0], seen[index]), index
            assert inputs[0][1]["state"] is None  # no cache: each block starts from a zero state, as in a fresh one
            inputs = propagate(block, inputs, calibration=True)


def test_sparsegpt_prunes_every_rwkv_block_matrix_by_half_at_batch_size_three():
    """The tester's repro (batch size 3 raised "too many values to unpack (expected 3)"): every block Linear is now
    exactly half zero, the ignored head untouched."""
    model = build_rwkv()
    head = model.head.weight.detach().clone()
    llmc_fsm.oneshot(model=model, recipe=SPARSEGPT, dataset=_tokens(3), batch_size=3, progress=False)
    zeros = {n: float((m.weight == 0).float().mean()) for n, m in model.named_modules() if n.startswith("rwkv.blocks")
             and isinstance(m, torch.nn.Linear)}  # fmt: skip
    assert len(zeros) == 14 and set(zeros.values()) == {0.5}
    assert torch.equal(model.head.weight, head)


def test_sparsegpt_prunes_the_rwkv_head_after_the_last_block_when_it_is_a_target():
    """With the head a target (the CLI's ``--method sparsegpt`` ignores ``lm_head``, not RWKV's ``head``), the
    pipeline runs the last block on its captured arguments: a stand-in for the recurrent state the capture left
    there reached ``RwkvSelfAttention`` ("'_NotComputed' object is not subscriptable")."""
    model = build_rwkv()
    recipe = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "targets": ["Linear"], "ignore": []}}}
    llmc_fsm.oneshot(model=model, recipe=recipe, dataset=_tokens(2), progress=False)
    assert float((model.head.weight == 0).float().mean()) == 0.5


def test_an_rwkv_model_that_rescales_its_blocks_is_refused_before_any_work():
    """With rescale_every below the layer count, RwkvModel.forward halves the hidden states between blocks (which
    the block-by-block pipeline does not) and divides later blocks' output weights in place at its first inference
    forward (which would be calibrated and saved): it is refused before any work, the model left as it was."""
    model = build_rwkv(layers=4, rescale_every=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedArchitectureError) as err:
        llmc_fsm.oneshot(model=model, recipe=SPARSEGPT, dataset=_tokens(2), progress=False)
    assert str(err.value) == RESCALING
    assert not model.rwkv.layers_are_rescaled
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with torch.no_grad():  # what the refusal avoids: a plain inference forward divides block 2's weights in place
        model(_tokens(1))
    output = "rwkv.blocks.2.attention.output.weight"
    assert torch.equal(model.get_parameter(output), before[output] / 2)


def test_explain_with_a_rescaling_rwkv_directory_refuses_a_calibrated_recipe_as_oneshot_does(tmp_path, capsys):
    """``explain RECIPE --model DIR`` said oneshot's checks pass on an RWKV directory whose oneshot then crashed."""
    from llmc_fsm.cli import main

    build_rwkv(layers=4, rescale_every=2).save_pretrained(tmp_path / "rwkv")
    (tmp_path / "sg.yaml").write_text("s:\n  SparseGPTModifier: {sparsity: 0.5, targets: [Linear], ignore: [head]}\n")
    capsys.readouterr()
    assert main(["explain", str(tmp_path / "sg.yaml"), "--model", str(tmp_path / "rwkv")]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"llmc-fsm explain: error: oneshot would refuse this recipe on --model {tmp_path / 'rwkv'}: {RESCALING}"
    )


def test_an_lm_head_ignore_says_nothing_when_another_entry_keeps_the_models_head_dense(caplog):
    """``ignore: [lm_head, head]`` on RWKV (head ``head``) warned "give ignore: [head] to keep it dense" though
    ``head`` was already ignored."""
    model = build_rwkv()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.targets"):
        selected = resolve_targets(model, ["Linear"], ["lm_head", "head"], ignore_given=True)
        resolve_targets(model, ["re:.*feed_forward.*"], ["lm_head", "head"], ignore_given=True)  # head not a target
    assert "head" not in selected and len(selected) == 14
    assert caplog.records == []


def test_explain_with_fuse_stages_says_the_calibrated_stages_share_one_pass():
    """``explain --fuse-stages`` still said each stage runs its own layer-by-layer calibration pass."""
    recipe = {
        "smooth_stage": {"AWQModifier": {}},
        "quant_stage": {"QuantizationModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}}},
    }
    fused = [line for line in explain(Session(recipe), fuse_stages=True).splitlines() if line.startswith("One-shot")]
    assert fused == [
        "One-shot (fuse_stages): stages 'smooth_stage', 'quant_stage' share one layer-by-layer calibration pass: at "
        "each decoder layer every stage's modifiers compress it in recipe order before the calibration inputs move on "
        "through the compressed layer (see docs/quantization.md)."
    ]
    apart = [line for line in explain(Session(recipe)).splitlines() if line.startswith("One-shot")]
    assert apart == [
        "One-shot: stages 'smooth_stage', 'quant_stage' run in that order, one layer-by-layer calibration pass each, "
        "every pass on the model the previous stages compressed (oneshot(fuse_stages=True) shares one pass; see "
        "docs/quantization.md)."
    ]


def test_explain_with_fuse_stages_checks_awq_against_the_quantizer_of_the_other_stage():
    """Found re-reading the fix: under ``--fuse-stages`` explain still checked AWQ against its own stage's modifiers
    only and printed "refused by one-shot: ... no modifier of this stage quantizes ...", which the fused run does
    not refuse (the quantizer of the next stage is in the one fused session)."""
    from tiny_llama import llama

    recipe = {
        "smooth_stage": {"AWQModifier": {}},
        "quant_stage": {"QuantizationModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}}},
    }
    session = Session(recipe)
    session.update_state(model=llama())
    fused = explain(session, fuse_stages=True)
    assert "refused by one-shot" not in fused
    assert "mapping input_layernorm -> q_proj, k_proj, v_proj (2x: model.layers.{0..1}.input_layernorm)" in fused
    assert "refused by one-shot: AWQModifier: no modifier of this stage quantizes" in explain(session)
