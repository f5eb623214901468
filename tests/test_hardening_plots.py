"""Issue 27: every plot kind is drawn to a PNG whose titles and legends fit inside the figure.

Kinds: pruning with a measured error (SparseGPT), pruning without (magnitude), 2:4 then GPTQ W4A16 (two modifiers:
the longest error title), GPTQ W4A16 alone, round-to-nearest W8A8 (quantized, nothing pruned, no error measured:
the plot must say the model is quantized), and a model without decoder layers. Each report comes from a real
one-shot run on a tiny model; the PNGs are written to ``$LLMC_FSM_PLOT_DIR`` when set (to look at them).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tiny_llama
import torch

import llmc_fsm

pytest.importorskip("matplotlib")
pytest.importorskip("llmc_fsm_pruning")
pytest.importorskip("llmc_fsm_quantization")

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from llmc_fsm.report import plot as plot_module

G32 = {"preset": "W4A16", "weights": {"group_size": 32}}
ALL = {"targets": ["Linear"], "ignore": ["lm_head"]}
KINDS = {
    "sparsegpt": {"p": {"SparseGPTModifier": {"sparsity": 0.5, **ALL}}},
    "magnitude": {"p": {"MagnitudePruningModifier": {"sparsity": 0.5, **ALL}}},
    "2of4-w4a16": {
        "sparsity_stage": {"SparseGPTModifier": {"sparsity": 0.5, "mask_structure": "2:4", **ALL}},
        "quantization_stage": {"GPTQModifier": {"scheme": G32, **ALL}},
    },
    "gptq-w4a16": {"q": {"GPTQModifier": {"scheme": G32, **ALL}}},
    "rtn-w8a8": {"q": {"QuantizationModifier": {"scheme": "W8A8", **ALL}}},
}


def _report(recipe) -> dict:
    model = tiny_llama.llama(vocab=96, hidden=64, layers=3, heads=2, kv_heads=1, positions=2048)
    data = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))
    out = llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, batch_size=4, fuse_stages=True, progress=False)
    report = out.llmc_fsm_report.to_dict()
    report["model"] = "out/smollm2-135m-sparsegpt-2of4-then-gptq-w4a16-group64"  # a long name, as a user's
    return report


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    found = {kind: _report(recipe) for kind, recipe in KINDS.items()}
    seq = torch.nn.Sequential(torch.nn.Embedding(16, 16), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    torch.manual_seed(0)
    out = llmc_fsm.oneshot(
        model=seq, recipe={"p": {"MagnitudePruningModifier": {"sparsity": 0.5, "targets": ["Linear"], "ignore": []}}},
        dataset=torch.randint(0, 16, (4, 8)), progress=False,
    )
    found["no-layers"] = out.llmc_fsm_report.to_dict()
    return found


def _drawn(monkeypatch) -> list[Figure]:
    figures: list[Figure] = []
    original = Figure.savefig

    def savefig(self, *a, **k):
        figures.append(self)
        return original(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


@pytest.mark.parametrize("kind", [*KINDS, "no-layers"])
def test_every_plot_kind_fits_its_titles_and_legends_in_the_figure(reports, kind, tmp_path, monkeypatch):
    folder = Path(os.environ.get("LLMC_FSM_PLOT_DIR", tmp_path))
    figures = _drawn(monkeypatch)
    path = plot_module.plot_report(reports[kind], folder / f"{kind}.png")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    canvas = FigureCanvasAgg(fig)  # matplotlib's Agg renderer, as savefig used for the PNG
    canvas.draw()
    renderer = canvas.get_renderer()
    box = fig.bbox
    texts = [ax.title for ax in fig.axes] + [t for ax in fig.axes if ax.get_legend() for t in [ax.get_legend()]]
    assert [ax.title.get_text() != "" for ax in fig.axes] == [True] * len(fig.axes)
    for artist in texts:
        extent = artist.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1, (
            kind,
            artist,
            extent,
            box,
        )
    titles = [ax.title.get_text().replace("\n", " ") for ax in fig.axes]
    if kind in ("2of4-w4a16", "gptq-w4a16", "rtn-w8a8"):
        assert "quantized: " in titles[0]
    if kind == "rtn-w8a8":
        assert len(fig.axes) == 1  # no error was measured: one panel
        assert titles[0].endswith("; quantized: 8 bits on 21 modules")
        notes = [t.get_text() for t in fig.axes[0].texts]
        assert notes == ["nothing pruned: the model is quantized: 8 bits on 21 modules\n(no relative output error was measured)"]
    if kind == "2of4-w4a16":
        assert titles[1].startswith("the last step (quantization, after pruning): relative output error")
