"""Calibration inputs holding NaN / Inf (a NaN weight upstream, a float16 overflow): GPTQ stops at the first group
whose Hessian is not finite, naming its modules and the likely cause, before changing them; one-shot on a model
passed in memory adds a note naming what it had already compressed (found by a tester: the error said only "hessian
contains NaN or Inf values", and "No parameter of the model was changed" while earlier groups were quantized)."""

from __future__ import annotations

import pytest
import tiny_llama
import torch

pytest.importorskip("transformers")

import llmc_fsm  # noqa: E402
from llmc_fsm import ModifierError  # noqa: E402



def test_a_nan_upstream_stops_gptq_at_the_group_it_reaches_naming_it():
    model = tiny_llama.llama(hidden=64, vocab=128)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
    o_proj = model.model.layers[0].self_attn.o_proj.weight.detach().clone()
    scheme = {"preset": "W4A16", "weights": {"group_size": 32}}
    recipe = {"s": {"GPTQModifier": {"scheme": scheme, "ignore": ["lm_head"]}}}
    with pytest.raises(ModifierError) as info:
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=torch.randint(0, 128, (4, 32)), progress=False)
    message = str(info.value)
    assert message.startswith(
        "GPTQModifier.on_sequential_epoch_end() raised ValueError: GPTQModifier: the calibration inputs of "
        "model.layers.0.self_attn.o_proj hold NaN or Inf values (their Hessian is not finite), so they cannot be "
        "compressed: the activations overflowed before them (a float16 model: load it in float32, --dtype float32) "
        "or a weight before them holds NaN or Inf (during sequential_epoch_end())."
    )
    assert info.value.__notes__ == [
        "oneshot: the model you passed was changed in place before this error (3 modules compressed: "
        "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj); reload "
        "it before another run."
    ]
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, o_proj)  # the failing group: untouched


def test_a_write_through_data_moves_the_version_counter_the_session_guard_reads():
    """The quantization plugin takes a new weight's storage (``weight.data = new``) or copies into ``.data``: neither
    moves ``_version``, so a failed hook after such a write was reported as having changed nothing."""
    from llmc_fsm_quantization._base import _take_weight

    weight = torch.nn.Parameter(torch.zeros(4, 4))
    before = weight._version
    _take_weight(weight, torch.ones(4, 4))  # same shape, dtype, device: the storage is taken
    assert torch.equal(weight, torch.ones(4, 4)) and weight._version > before
    before = weight._version
    _take_weight(weight, torch.full((4, 8), 2.0)[:, :4])  # not contiguous: copied into .data
    assert torch.equal(weight, torch.full((4, 4), 2.0)) and weight._version > before
