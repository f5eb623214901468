"""Session 39 fixes (a): generated recipes on multimodal models, small calibration sets."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from llmc_fsm.cli import main
from llmc_fsm.oneshot_job.settings import RecipeFlags, multimodal_dense


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    from tiny_families import build
    from tiny_llama import calibration_text, word_tokenizer

    directory = tmp_path_factory.mktemp("llava")
    build("llava").save_pretrained(directory)
    word_tokenizer(calibration_text()).save_pretrained(directory)
    return directory


def test_the_default_recipe_leaves_a_vision_language_models_tower_dense(llava_dir, tmp_path, caplog):
    """Found by a tester: the CLI's default method (and --method gptq/sparsegpt/wanda) on any vision-language model
    loaded it, then stopped with "SparseGPTModifier targets model.vision_tower..., outside the decoder layers; Add
    them to the modifier's ignore list", and the command has no --ignore flag. The generated recipe now leaves the
    tower and projector dense, as llm-compressor's multimodal examples do, and says so in one log line."""
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.oneshot_job.settings"):
        status = main(["oneshot", "--model", str(llava_dir), "--num-samples", "2", "--seq-len", "16", "--output",
                       str(out)])  # fmt: skip
    assert status == 0
    assert [r.getMessage() for r in caplog.records if r.name == "llmc_fsm.oneshot_job.settings"] == [
        "--method sparsegpt leaves the Linears outside the language model's decoder layers dense (ignore "
        r"re:model\.vision_tower\., re:model\.multi_modal_projector\.), as llm-compressor's multimodal examples do; "
        "give a --recipe to choose otherwise"
    ]
    dense = load_file(llava_dir / "model.safetensors")
    saved = load_file(out / "model.safetensors")
    tower = [k for k in dense if "vision_tower" in k or "multi_modal_projector" in k]
    assert tower and all(torch.equal(saved[k], dense[k]) for k in tower)
    pruned = saved["language_model.model.layers.0.mlp.up_proj.weight"]
    assert (pruned == 0).float().mean().item() == 0.5


def test_the_tower_ignore_patterns_are_read_from_the_config(llava_dir, tmp_path):
    """What the generated recipe ignores on a multimodal model: one pattern per outermost module holding the Linears
    outside the decoder layers and the output head; none for a text model."""
    from tiny_families import build

    assert multimodal_dense(llava_dir) == (r"re:model\.vision_tower\.", r"re:model\.multi_modal_projector\.")
    build("llama").save_pretrained(tmp_path / "llama")
    assert multimodal_dense(tmp_path / "llama") == ()
    assert multimodal_dense(tmp_path / "missing") == ()


@pytest.mark.parametrize(("method", "ignored"), [
    ("gptq", ["lm_head", "re:tower\\."]), ("wanda", ["lm_head", "re:tower\\."]), ("rtn", ["lm_head"]),
    ("magnitude", ["lm_head"]),
])  # fmt: skip
def test_only_the_calibrated_methods_leave_the_tower_dense(method, ignored):
    """--method rtn / magnitude need no calibration inputs and compress every Linear but lm_head, tower included (as
    documented before); the calibrated methods, which could not run on the tower, leave it dense."""
    (stage,) = RecipeFlags(method=method).recipe((r"re:tower\.",)).stages
    assert list(stage.modifiers[0].ignore) == ignored


def test_more_samples_than_a_datasets_rows_uses_them_all_with_one_warning(tiny_model_dir, tmp_path, caplog):
    """Found by a tester: oneshot(dataset=<8 rows>, num_calibration_samples=512), as llm-compressor's examples set it,
    was refused; llm-compressor 0.14 warns and uses the 8 rows. Now all rows are used with one warning naming both
    numbers, and the report and the resume fingerprint record the 8 used."""
    import json

    import llmc_fsm
    from llmc_fsm.oneshot_job.settings import OneshotSettings

    model_dir, text = tiny_model_dir
    rows = text.read_text().split()[:8 * 20]
    texts = [" ".join(rows[i * 20:(i + 1) * 20]) for i in range(8)]
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.oneshot_job.settings"):
        llmc_fsm.oneshot(model=str(model_dir), dataset=texts, num_calibration_samples=512, max_seq_length=16,
                         output_dir=out, progress=False)  # fmt: skip
    assert [r.getMessage() for r in caplog.records if r.name == "llmc_fsm.oneshot_job.settings"] == [
        "num_calibration_samples (--num-samples) asks for 512 samples but the dataset has only 8 rows: using all 8"
    ]
    assert json.loads((out / "report.json").read_text())["calibration"]["num_samples"] == 8
    settings = OneshotSettings(model=str(model_dir), dataset=texts, num_calibration_samples=512)
    assert settings.num_calibration_samples == 8
    assert settings.fingerprint_values()[("calibration data", "num_samples")] == 8


def test_more_samples_than_a_token_tensors_rows_is_still_refused():
    """A token tensor is llmc-fsm's own input form: a count above its rows stays a one-line refusal."""
    from llmc_fsm.oneshot_job.settings import OneshotSettings

    with pytest.raises(ValueError) as info:
        OneshotSettings(dataset=torch.zeros(2, 8, dtype=torch.long), num_calibration_samples=3)
    assert str(info.value) == (
        "num_calibration_samples (--num-samples) 3 is more than the 2 rows of the dataset tensor (2, 8); pass at most "
        "2, or leave it out to use them all"
    )


def test_the_python_default_recipe_leaves_a_vision_language_models_tower_dense(llava_dir, tmp_path, caplog):
    """oneshot(model=<a VL model's directory>) without a recipe was refused (the tower outside the decoder layers),
    where the CLI's default now runs: the Python default recipe leaves the tower dense the same way, with one line."""
    import llmc_fsm

    with caplog.at_level(logging.WARNING, logger="llmc_fsm.oneshot_job.phases"):
        llmc_fsm.oneshot(model=str(llava_dir), num_calibration_samples=2, max_seq_length=16, progress=False,
                         output_dir=str(tmp_path / "out"))  # fmt: skip
    assert [r.getMessage() for r in caplog.records if r.name == "llmc_fsm.oneshot_job.phases"] == [
        "the default recipe leaves the Linears outside the language model's decoder layers dense (ignore "
        r"re:model\.vision_tower\., re:model\.multi_modal_projector\.), as llm-compressor's multimodal examples do; "
        "give a recipe to choose otherwise"
    ]
    dense, saved = load_file(llava_dir / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    tower = [k for k in dense if "vision_tower" in k or "multi_modal_projector" in k]
    assert tower and all(torch.equal(saved[k], dense[k]) for k in tower)
    assert (saved["language_model.model.layers.0.mlp.up_proj.weight"] == 0).float().mean().item() == 0.5


def test_the_python_default_recipe_leaves_a_loaded_vision_language_models_tower_dense(llava_dir, tmp_path, caplog):
    """Left last session: a VL model passed already loaded (an ``nn.Module``) with no recipe was still refused (the
    tower ignore patterns were read from a directory's config only); its own modules now give them, as a directory's
    config does."""
    from tiny_llama import calibration_text, word_tokenizer
    from transformers import AutoModelForImageTextToText

    import llmc_fsm

    model = AutoModelForImageTextToText.from_pretrained(llava_dir)
    assert multimodal_dense(model) == multimodal_dense(str(llava_dir))
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.oneshot_job.phases"):
        llmc_fsm.oneshot(model=model, tokenizer=word_tokenizer(calibration_text()), num_calibration_samples=2,
                         max_seq_length=16, progress=False)  # fmt: skip
    assert [r.getMessage() for r in caplog.records if r.name == "llmc_fsm.oneshot_job.phases"] == [
        "the default recipe leaves the Linears outside the language model's decoder layers dense (ignore "
        r"re:model\.vision_tower\., re:model\.multi_modal_projector\.), as llm-compressor's multimodal examples do; "
        "give a recipe to choose otherwise"
    ]
    after = model.state_dict()
    tower = [k for k in dense if "vision_tower" in k or "multi_modal_projector" in k]
    assert tower and all(torch.equal(after[k], dense[k]) for k in tower)
    assert (after["model.language_model.layers.0.mlp.up_proj.weight"] == 0).float().mean().item() == 0.5
