"""One-shot ``--resume`` of a stage with a smoothing modifier: interrupted after a decoder layer, the resumed run
restores the saved layers (weights and what the smoothing did there) and gives the uninterrupted run's result."""

from __future__ import annotations

import pytest
import torch
from llmc_fsm_quantization.smoothquant import SmoothingModifier
from test_smoothquant import DATA, tiny

import llmc_fsm
from llmc_fsm.oneshot_job.resume import LayerProgress, resumable

W4G16 = {"preset": "W4A16_ASYM", "weights": {"group_size": 16}}

RECIPES = {
    "awq+rtn, clipping": {
        "q": {
            "AWQModifier": {"apply_clip": True, "duo_scaling": "both"},
            "QuantizationModifier": {"scheme": W4G16},
        }
    },
    "awq, scheme on it": {"q": {"AWQModifier": {"scheme": W4G16}}},
    "smoothquant+gptq": {"q": {"SmoothQuantModifier": {"smoothing_strength": 0.8}, "GPTQModifier": {"scheme": "W8A8"}}},
    "logeq+rtn": {"q": {"LogarithmicEqualizationModifier": {}, "QuantizationModifier": {"scheme": "W8A8"}}},
    "smoothquant, then gptq": {
        "s": {"SmoothQuantModifier": {}},
        "q": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 16}}}},
    },
}


def _interrupt_after(monkeypatch, layer: int, pass_index: int = 0) -> None:
    original = LayerProgress.save

    def save(self, index, module):
        original(self, index, module)
        if index == layer and self.directory.name == f"pass-{pass_index}":
            raise KeyboardInterrupt

    monkeypatch.setattr(LayerProgress, "save", save)


def _count_prepared(monkeypatch) -> list[str]:
    prepared: list[str] = []
    original = SmoothingModifier.prepare_layer

    def prepare_layer(self, layer, inputs):
        prepared.append(type(self).__name__)
        return original(self, layer, inputs)

    monkeypatch.setattr(SmoothingModifier, "prepare_layer", prepare_layer)
    return prepared


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_a_smoothing_stage_interrupted_after_layer_0_resumes_to_the_same_weights_and_report(
    tmp_path, monkeypatch, recipe
) -> None:
    kw = {"recipe": recipe, "dataset": DATA, "batch_size": 4, "fuse_stages": False, "progress": False}
    ref = llmc_fsm.oneshot(model=tiny(), **kw)
    with monkeypatch.context() as m:
        _interrupt_after(m, layer=0, pass_index=len(recipe) - 1)
        with pytest.raises(KeyboardInterrupt):
            llmc_fsm.oneshot(model=tiny(), output_dir=tmp_path / "o", **kw)
    saved = sorted(p.name for p in (tmp_path / ".o.work" / "progress").rglob("layer-*.safetensors"))
    assert saved == ["layer-00000.safetensors"] * len(recipe) + (["layer-00001.safetensors"] if len(recipe) > 1 else [])
    with monkeypatch.context() as m:
        prepared = _count_prepared(m)
        out = llmc_fsm.oneshot(model=tiny(), output_dir=tmp_path / "o", resume=True, **kw)
    # the resumed run smoothed only layer 1 of the interrupted pass (a finished earlier pass: not at all)
    assert len(prepared) == (1 if "s" not in recipe else 0)
    ref_state, out_state = ref.state_dict(), out.state_dict()
    assert ref_state.keys() == out_state.keys()
    assert [k for k in ref_state if not torch.equal(ref_state[k], out_state[k])] == []
    ref_report, out_report = ref.llmc_fsm_report.to_dict(), out.llmc_fsm_report.to_dict()
    assert out_report["smoothing"] == ref_report["smoothing"]
    assert len(next(iter(out_report["smoothing"].values()))) >= 4  # both layers' mappings, restored and new
    assert out_report["sparsity"]["modules"] == ref_report["sparsity"]["modules"]  # bits, errors of each module


def test_a_modifier_with_own_per_layer_state_and_no_progress_state_keeps_no_progress() -> None:
    class Counting(llmc_fsm.Modifier):
        def on_sequential_epoch_end(self, state, modules):
            pass

    class Session:
        def __init__(self, modifier: llmc_fsm.Modifier) -> None:
            self.modifiers = [modifier]

    assert not resumable(Session(Counting()))  # type: ignore[arg-type]
    assert resumable(Session(SmoothingModifier()))  # type: ignore[arg-type]
