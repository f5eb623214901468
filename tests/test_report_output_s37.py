"""One-shot output and report, session 37 (found by testers): the overlap warning judged by token positions, no
``torch_dtype`` deprecation warning, one definition of the per-layer error in the report's table and plot, one summary
line per layer for idle experts, the session path's sparsity_config, and smaller report notes."""

from __future__ import annotations

import logging

import tiny_llama
import torch
from tiny_families import build

import llmc_fsm


def test_an_evaluation_head_ending_with_the_token_the_calibration_tail_begins_with_is_not_overlap(tmp_path, caplog):
    """Found by a tester: the overlap of calibration (the text's tail) and evaluation (its head) was judged by content:
    an evaluation head that ended with the token the calibration began with (one `` of``) warned "1 of the 256
    evaluation tokens were calibrated on" though 14,428 tokens lay between them. Now by positions: 72 words, 32 of
    evaluation from the head and 32 of calibration from the tail, word 31 equal to word 40, nothing shared."""
    model_dir, text_file = tiny_llama.build_with_text(tmp_path)
    words = text_file.read_text().split()
    head, gap, tail = words[:32], words[100:108], [words[31], *words[200:231]]
    assert words[31] not in words[200:231] + words[100:108]  # the one coincidence
    text = tmp_path / "ov.txt"
    text.write_text(" ".join(head + gap + tail))
    args = {"model": str(model_dir), "dataset": str(text), "eval_text": str(text), "max_seq_length": 16,
            "progress": False, "recipe": {"s": {"SparseGPTModifier": {"sparsity": 0.5}}}}  # fmt: skip
    with caplog.at_level("WARNING"):
        llmc_fsm.oneshot(**args, num_calibration_samples=2, num_eval_windows=2)
    assert [m for m in caplog.messages if "calibrated on" in m] == []
    caplog.clear()
    with caplog.at_level("WARNING"):  # 3 calibration windows: words 24-71, 8 of the 32 evaluation words
        llmc_fsm.oneshot(**args, num_calibration_samples=3, num_eval_windows=2)
    assert [m for m in caplog.messages if "calibrated on" in m] == [
        "calibration and evaluation read the same text, which is too short to keep them apart: 8 of the 32 "
        "evaluation tokens were calibrated on, so the perplexity after compression is optimistic; use a longer "
        "text, fewer --num-samples / --eval-windows, or another --eval-text"
    ]


def test_an_in_memory_model_saved_with_output_dir_gives_no_torch_dtype_deprecation_warning(tmp_path):
    """Found by a tester: the resume fingerprint read ``config.torch_dtype`` of a model built ``from_config`` (no
    dtype in its config), and transformers 5 warned "`torch_dtype` is deprecated! Use `dtype` instead!"."""
    import transformers

    seen: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Seen()
    root = transformers.utils.logging.get_logger("transformers")
    root.addHandler(handler)
    logging.Logger.warning_once.cache_clear()  # said once per process: another test may have said it
    try:
        model = build("llama")
        assert model.config.dtype is None
        data = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        recipe = {"q": {"QuantizationModifier": {"scheme": "W8A8", "ignore": ["lm_head"]}}}
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=tmp_path / "out", progress=False)
    finally:
        root.removeHandler(handler)
    assert [m for m in seen if "torch_dtype" in m] == []


def _stacked_report(layers: int = 1, numel: int = 100) -> dict:
    """A report of 2:4 SparseGPT then GPTQ W4A16 g32 with ``down_proj`` ignored by GPTQ: per layer q_proj (numel,
    errors 0.3 then 0.1), k_proj (3 numel, 0.5 then 0.2), down_proj (2 numel, only pruned, 0.4)."""
    steps = ("SparseGPTModifier (sparsity_stage)", "GPTQModifier (quantization_stage)")

    def entry(layer: int, name: str, size: int, errors: tuple[float, ...]) -> dict:
        quantized = len(errors) > 1
        return {"name": f"model.layers.{layer}.{name}", "layer": layer, "zeros": size // 2, "numel": size,
                "sparsity": 0.5, "targeted": True, "rel_output_error": errors[-1],
                **({"bits": 4, "group_size": 32, "quantized": "int4/g32"} if quantized else {}),
                **({"rel_output_errors": [{"modifier": s, "rel_output_error": e}
                                          for s, e in zip(steps, errors, strict=True)]}
                   if quantized else {})}  # fmt: skip

    modules = [
        e
        for i in range(layers)
        for e in (entry(i, "self_attn.q_proj", numel, (0.3, 0.1)), entry(i, "self_attn.k_proj", 3 * numel, (0.5, 0.2)),
                  entry(i, "mlp.down_proj", 2 * numel, (0.4,)))
    ]  # fmt: skip
    return {"model": "m", "calibration": {"source": "cal.txt", "num_samples": 8, "seq_len": 64},
            "sparsity": {"modules": modules}, "seconds": {"total": 1.0}}  # fmt: skip


def test_the_error_column_and_the_plot_of_prune_then_quantize_show_the_same_modules(tmp_path, monkeypatch):
    """Found by a tester: after 2:4 pruning then GPTQ with down_proj ignored by GPTQ, the table's per-layer error
    was the quantized modules' mean (0.0573) while the plot's panel, titled "the last step (quantization, after
    pruning)", also drew down_proj's pruning error (0.0857), and the table's note described the plot. Both now show
    the quantized modules' errors, and the note says so and names what it leaves out."""
    from matplotlib.figure import Figure

    from llmc_fsm.report.build import OneshotReport
    from llmc_fsm.report.plot import plot_report

    data = _stacked_report()
    lines = OneshotReport.from_dict(data).format_table().splitlines()
    mean = (100 * 0.1 + 300 * 0.2) / 400  # q_proj and k_proj, weighted by size: 0.175
    assert lines[4] == f"      0         600    50.00%  int4/g32*  {mean:>16.4f}"
    assert lines[-5] == (
        "rel. output error: the last modifier's, against the weights it received, of the quantized modules where a "
        "row has some (as the plot's error panel); 2 modules were compressed by several modifiers, whose errors do "
        "not add up (mean per module: SparseGPTModifier (sparsity_stage) 0.4000, GPTQModifier (quantization_stage) "
        "0.1500; report.json: rel_output_errors); left out of the column and the plot: 1 modules not quantized "
        "(model.layers.0.mlp.down_proj, mean error 0.4000)"
    )
    drawn: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: drawn.append(self))
    plot_report(data, tmp_path / "p.png")
    panel = drawn[0].axes[1]
    (line, *markers) = panel.get_lines()
    assert line.get_label() == "layer mean" and list(line.get_ydata()) == [mean]
    assert sorted(float(y) for m in markers for y in m.get_ydata()) == [0.1, 0.2]


def test_idle_fused_experts_under_sparsegpt_are_said_once_per_layer(caplog):
    """Found by a tester: on an 8-expert model whose router sends every token to experts 0 and 1, SparseGPT logged
    "... experts.E.up_proj received no calibration input; left as it was" for each idle expert matrix and then the
    layer's summary naming the same matrices again (64 lines for 4 layers). Now the summary only, as GPTQ."""
    model = build("qwen3_moe", num_experts_per_tok=1, num_experts=8)
    with torch.no_grad():
        for layer in model.model.layers:  # the router picks expert 0 or 1 for every token
            gate = layer.mlp.gate.weight
            v = torch.randn(gate.shape[1], generator=torch.Generator().manual_seed(0))
            gate.zero_()
            gate[0], gate[1] = v, -v
    data = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    recipe = {"s": {"SparseGPTModifier": {"sparsity": 0.5, "ignore": ["lm_head", "re:.*mlp.gate$"]}}}
    with caplog.at_level("WARNING"):
        llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, progress=False)
    idle = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(len(model.model.layers)) for e in range(2, 8)
            for p in ("gate_proj", "up_proj", "down_proj")]  # fmt: skip
    said = [m for m in caplog.messages if any(n + " " in m or n + "," in m or m.endswith(n) for n in idle)]
    per_layer = [
        f"SparseGPTModifier: the router sent no calibration token to 18 expert matrices: "
        f"{', '.join(n for n in idle if n.startswith(f'model.layers.{i}.'))}; left as they were; set "
        "calibrate_all_experts: true to prune them from every token's statistics"
        for i in range(len(model.model.layers))
    ]
    assert said == per_layer


def test_save_pretrained_after_a_session_writes_the_sparsity_config_oneshot_writes(tmp_path):
    """Found by a tester: after ``Session(recipe)`` + ``run_sequential`` + ``finalize``, ``model.save_pretrained``
    wrote ``"sparsity_config": {}`` for SparseGPT 2:4 + GPTQ W4A16 in one stage, where ``oneshot(output_dir=...)``
    wrote the dense format with the 2:4 structure and its targets (the session path had no report to read the
    zeros the modules held before quantization from). Both now write the same."""
    import json

    from llmc_fsm.pipeline.sequential import run_sequential

    recipe = {"stage": {"modifiers": {
        "SparseGPTModifier": {"sparsity": 0.5, "mask_structure": "2:4", "targets": ["Linear"], "ignore": ["lm_head"]},
        "GPTQModifier": {"ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}},
    }}}  # fmt: skip
    data = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    llmc_fsm.oneshot(model=build("llama"), recipe=recipe, dataset=data, output_dir=tmp_path / "oneshot", progress=False)
    model = build("llama")
    session = llmc_fsm.Session(recipe)
    session.initialize(model=model, calibration_data=data)
    run_sequential(session, progress=False)
    session.finalize()
    model.save_pretrained(tmp_path / "session")

    def sparsity_config(name: str) -> dict:
        return json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]["sparsity_config"]

    expected = sparsity_config("oneshot")
    assert (expected["format"], expected["sparsity_structure"]) == ("dense", "2:4")
    assert expected["targets"] == sorted(f"model.layers.{i}.{p}" for i in range(len(model.model.layers)) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))  # fmt: skip
    assert sparsity_config("session") == expected


def test_model_free_on_the_command_line_says_the_flag_that_quantizes_lm_head_too(tmp_path, caplog):
    """Found by a tester: ``llmc-fsm model-free MODEL --scheme W8A8`` without ``--ignore`` warned "give ``ignore:
    []`` for that", a recipe's field the command does not take; on the command line it is ``--ignore`` with no
    name (the API, ``model_free_ptq``, keeps the recipe's words)."""
    from llmc_fsm.cli import main

    tiny_llama.llama(layers=1, tied=False).save_pretrained(tmp_path / "m")
    with caplog.at_level("WARNING"):
        argv = ["model-free", str(tmp_path / "m"), "--scheme", "W8A8", "--output", str(tmp_path / "o"), "--no-progress"]
        assert main(argv) == 0
    assert [m for m in caplog.messages if "no ignore given" in m] == [
        "QuantizationModifier: no ignore given: lm_head is kept dense (ignore: [lm_head]; llm-compressor's default "
        "ignore is empty, which quantizes lm_head too: give --ignore with no name for that)"
    ]
    caplog.clear()
    with caplog.at_level("WARNING"):
        llmc_fsm.model_free_ptq(str(tmp_path / "m"), tmp_path / "api", scheme="W8A8", progress=False)
    assert next(m for m in caplog.messages if "no ignore given" in m).endswith("give ignore: [] for that)")


def test_the_notes_follow_the_total_row_and_the_weights_column_fits_the_total():
    """Found by a tester: the notes under the table (``*:``, ``rel. output error:``, SmoothQuant, KV scales,
    ``experts:``) were printed between the layer rows and the ``total`` row, and ``total 106,168,320`` overflowed
    the 10-character weights column. The notes now follow the total, and the column is as wide as the total."""
    from llmc_fsm.report.build import OneshotReport

    lines = OneshotReport.from_dict(_stacked_report(layers=2, numel=10_000_000)).format_table().splitlines()
    assert lines[3:7] == [
        "  layer      weights  sparsity  quantized  rel. output error",
        "      0   60,000,000    50.00%  int4/g32*            0.1750",
        "      1   60,000,000    50.00%  int4/g32*            0.1750",
        "  total  120,000,000    50.00%   (targeted weights)",
    ]
    assert [line.split(":")[0] for line in lines[7:10]] == [
        "(a quantized weight's sparsity counts the zeros it held before quantization; values that round to zero are "
        "not counted)",
        "*",
        "rel. output error",
    ]


def test_the_plot_titles_of_a_mixed_recipe_say_how_many_modules_have_a_group_size():
    """Found by a tester: a recipe of W4A16 g32 on the MLPs (12 modules) and W8A8 per channel on attention (16) was
    titled "quantized: 4/8 bits, group size 32 on 28 modules"; the titles now say on how many the group size is.
    An activation's zero point (``a:int8 asym``) is not counted as the weights' ``asym``."""
    from llmc_fsm.report.plot import error_panel_title, quantization_summary

    mlp = {"bits": 4, "group_size": 32, "quantized": "int4/g32", "rel_output_error": 0.1, "zeros": 0, "numel": 8}
    attn = {"bits": 8, "quantized": "int8 a:int8 asym static", "rel_output_error": 0.2, "zeros": 0, "numel": 8}
    entries = [mlp] * 12 + [attn] * 16
    assert quantization_summary(entries) == "quantized: 4/8 bits on 28 modules, group size 32 on 12 of them"
    assert error_panel_title(entries) == (
        "quantization: relative output error ||W X - Ŵ X|| / ||W X|| per module (bits 4/8, group_size 32 on 12 of "
        "28); line: mean weighted by size"
    )
    assert quantization_summary([mlp] * 12) == "quantized: 4 bits, group size 32 on 12 modules"


def test_report_plot_of_a_kv_cache_only_run_is_refused_before_printing(tmp_path, capsys):
    """Found by a tester: ``llmc-fsm report OUT --plot x.png`` of a run that calibrated only the KV cache's scales
    printed the report and then exited 1 "the report has no targeted module: nothing to plot". It is refused before
    anything is printed, in the way an unwritable plot path is, saying why; without --plot the report prints."""
    import json

    from llmc_fsm.cli import main

    data = _stacked_report()
    for entry in data["sparsity"]["modules"]:
        entry.update(targeted=False, zeros=0, sparsity=0.0)
        for key in ("bits", "group_size", "quantized", "rel_output_error", "rel_output_errors"):
            entry.pop(key, None)
    data["kv_cache"] = {"QuantizationModifier (s)": {"model.layers.0.self_attn": {"k_scale": [0.5], "v_scale": [0.25]}}}
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "report.json").write_text(json.dumps(data))
    assert main(["report", str(tmp_path / "o"), "--plot", str(tmp_path / "x.png")]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == (
        "llmc-fsm report: error: nothing to plot: the run targeted no weight (it calibrated only the KV cache's "
        "scales), and the plot draws the targeted weights' sparsity and output error per decoder layer; print the "
        "report without --plot"
    )
    assert not (tmp_path / "x.png").exists()
    assert main(["report", str(tmp_path / "o")]) == 0
    assert capsys.readouterr().out.startswith("model: m\n")
