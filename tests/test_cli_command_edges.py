"""Edges of the ``llmc-fsm`` commands' own flags and messages: ``model-free``, ``report``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from tiny_llama import llama

from llmc_fsm.cli import main


def _checkpoint(directory, capsys):
    llama(hidden=64, kv_heads=4).to(torch.bfloat16).save_pretrained(directory)
    capsys.readouterr()  # transformers' progress bar
    return str(directory)


def test_model_free_takes_a_group_size_for_an_int_group_scheme(tmp_path, capsys):
    """``model-free --scheme W4A16`` on widths that are no multiple of 128 advised ``--group-size 64``, a flag it did
    not have, so a CLI user could not run int group schemes on such a model (found by a tester)."""
    source = _checkpoint(tmp_path / "src", capsys)
    argv = ["model-free", source, "--scheme", "W4A16", "--group-size", "32", "--output", str(tmp_path / "out")]
    assert main([*argv, "--no-progress"]) == 0
    assert capsys.readouterr().out == f"output: {tmp_path / 'out'}\n"
    groups = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert groups["group_0"]["weights"]["group_size"] == 32
    assert load_file(tmp_path / "out" / "model.safetensors")["model.layers.0.mlp.down_proj.weight_scale"].shape == (
        64,
        4,
    )


def test_model_free_refuses_a_group_size_for_a_scheme_whose_format_fixes_its_group(tmp_path, capsys):
    """``--group-size`` with NVFP4A16 (groups of 16 by the format) is refused in one line naming the flag."""
    source = _checkpoint(tmp_path / "src", capsys)
    argv = ["model-free", source, "--scheme", "NVFP4A16", "--group-size", "32", "--output", str(tmp_path / "out")]
    assert main(argv) == 1
    assert capsys.readouterr().err == (
        "llmc-fsm model-free: error: model_free_ptq: group_size (--group-size) applies to presets whose int weights "
        "are quantized in groups (W2A16, W2A4, W2A8, W3A16, W3A4, W3A8, W4A16, W4A16_ASYM, W4A4, W4A8, W4AFP8, "
        "W5A16, W5A8, W6A16, W6A8, W7A16, W7A8, W8A16); NVFP4A16 quantizes float weights per tensor_group of 16: "
        "leave group_size out\n"
    )
    assert not (tmp_path / "out").exists()


def test_model_free_refuses_a_group_size_that_is_no_positive_int(tmp_path, capsys):
    """One line for ``--group-size``'s value, before anything is read: argparse's for no int (exit status 2), and
    for an int below 1 oneshot's, exit status 1 (argparse's status 2 until 2026-12-07, found by a tester)."""
    with pytest.raises(SystemExit) as info:
        main(["model-free", "m", "--scheme", "W4A16", "--group-size", "x", "--output", str(tmp_path / "o")])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "llmc-fsm model-free: error: argument --group-size: invalid int value: 'x'; see 'llmc-fsm model-free --help'\n"
    )
    assert main(["model-free", "m", "--scheme", "W4A16", "--group-size", "0", "--output", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err == "llmc-fsm model-free: error: --group-size must be a positive int, got 0\n"
    assert not (tmp_path / "o").exists()


def _report(tmp_path, change=None):
    """A report.json of a two-layer model (one module per layer, an lm_head outside), ``change(data)`` applied."""
    from llmc_fsm.report.build import ModuleSparsity, OneshotReport

    modules = [
        ModuleSparsity(name="model.layers.0.mlp.down_proj", layer=0, zeros=2, numel=8),
        ModuleSparsity(name="model.layers.1.mlp.down_proj", layer=1, zeros=4, numel=8),
        ModuleSparsity(name="lm_head", layer=None, zeros=0, numel=16),
    ]
    report = OneshotReport(model="m", recipe={}, calibration={}, modules=modules, targeted=[m.name for m in modules])
    data = report.to_dict()
    if change is not None:
        change(data["sparsity"]["modules"][1])
    (tmp_path / "report.json").write_text(json.dumps(data))
    return tmp_path


NOT_ERROR = "is neither a finite number >= 0 nor null"


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda m: m.update(layer="x"), "layer 'x' is neither a decoder layer index (an int >= 0) nor null"),
        (lambda m: m.update(layer=-1), "layer -1 is neither a decoder layer index (an int >= 0) nor null"),
        (lambda m: m.update(zeros=16, sparsity=2.0), "zeros 16 and numel 8 are not ints with 0 <= zeros <= numel"),
        (lambda m: m.update(zeros=-1), "zeros -1 and numel 8 are not ints with 0 <= zeros <= numel"),
        (lambda m: m.update(numel=2.5), "zeros 4 and numel 2.5 are not ints with 0 <= zeros <= numel"),
        (lambda m: m.update(sparsity=0.9), "sparsity 0.9 is not zeros / numel"),
        (lambda m: m.update(bits=0), "bits 0 is neither a positive int nor null"),
        (lambda m: m.update(group_size="g"), "group_size 'g' is neither a positive int nor null"),
        (lambda m: m.update(rel_output_error=-0.5), "rel_output_error -0.5 is neither a finite number >= 0 nor null"),
        # NaN passed the check (NaN < 0 is false) and was printed and plotted (found by a tester)
        (lambda m: m.update(rel_output_error=math.nan), "rel_output_error nan " + NOT_ERROR),
        (lambda m: m.update(rel_output_error=math.inf), "rel_output_error inf " + NOT_ERROR),
    ],
)
def test_report_refuses_a_module_field_oneshot_cannot_have_written(tmp_path, capsys, change, problem):
    """A hand-edited report.json with ``layer: "x"`` printed a row "x" and ``--plot`` died with a TypeError
    traceback; ``zeros`` above ``numel`` printed "sparsity 200.00%" (found by a tester). Refused in one line, before
    anything is printed or drawn."""
    out = _report(tmp_path, change)
    assert main(["report", str(out), "--plot", str(tmp_path / "p.png")]) == 1
    assert capsys.readouterr() == (
        "",
        f"llmc-fsm report: error: {out / 'report.json'}: not a one-shot report written by llmc-fsm oneshot "
        f"(sparsity.modules[1] 'model.layers.1.mlp.down_proj': {problem})\n",
    )
    assert not (tmp_path / "p.png").exists()


def test_report_reads_a_report_as_oneshot_writes_it(tmp_path, capsys):
    """The checks of the module fields accept what oneshot writes (lm_head outside the layers: layer null)."""
    out = _report(tmp_path)
    assert main(["report", str(out)]) == 0
    assert "\n      1           8    50.00%\n" in capsys.readouterr().out


def test_the_line_of_modules_outside_the_layers_sums_up_a_stack_and_fits_the_plot(tmp_path):
    """A LLaVA report listed its vision tower's modules one by one on the plot: the line ran off the picture and
    matplotlib warned "constrained_layout not applied", cutting the legend off (found by a tester)."""
    import warnings

    from llmc_fsm.report.build import ModuleSparsity, OneshotReport
    from llmc_fsm.report.plot import outside_layers_line, plot_report

    vision = [
        ModuleSparsity(name=f"model.vision_tower.encoder.layers.{i}.self_attn.{p}_proj", layer=None, zeros=i, numel=10)
        for i in range(6)
        for p in "qkvo"
    ]
    modules = [
        *(ModuleSparsity(name=f"model.language_model.layers.{i}.mlp.down_proj", layer=i, zeros=0, numel=8)
          for i in range(2)),
        *vision,
        *(ModuleSparsity(name=f"model.multi_modal_projector.linear_{i}", layer=None, zeros=1, numel=4)
          for i in (1, 2, 3)),
    ]
    report = OneshotReport(model="m", recipe={}, calibration={}, modules=modules, targeted=[m.name for m in modules])
    data = report.to_dict()
    outside = [e for e in data["sparsity"]["modules"] if e["layer"] is None]
    assert outside_layers_line(outside) == (  # (0+1+...+5) * 4 zeros of 240 weights: 25.0%
        "outside the layers: model.vision_tower.encoder.layers.* (24 modules) 25.0%, model.multi_modal_projector."
        "linear_1 25.0%, and 2 more"
    )
    assert outside_layers_line(outside[-1:]) == "outside the layers: model.multi_modal_projector.linear_3 25.0%"
    assert outside_layers_line([]) == ""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "constrained_layout not applied" is a UserWarning
        plot_report(data, tmp_path / "llava.png")


def test_modifiers_says_quantization_modifier_calibrates_static_activation_scales(capsys):
    """``llmc-fsm modifiers`` described QuantizationModifier's activations as "(dynamic)", while a scheme with
    static activation scales needs calibration_data (found by a tester)."""
    assert main(["modifiers"]) == 0
    assert (
        "      Quantize Linear weights by round-to-nearest; activations per the scheme (static: scales from "
        "calibration_data).\n" in capsys.readouterr().out
    )
