"""The public toolkit (``llmc_fsm.toolkit``) is enough to write a calibrated modifier, and the plugins use nothing else.

* Every first-party plugin module (and the example distribution) imports only public ``llmc_fsm`` names: those in
  ``llmc_fsm.__all__``, ``llmc_fsm.toolkit.__all__`` and ``llmc_fsm.testing.__all__`` (read with :mod:`ast`,
  imports inside functions and under ``TYPE_CHECKING`` included, and ``llmc_fsm.<name>`` attribute reads).
* Every public toolkit name has its own docstring and is named in docs/plugins.md.
* ``docs/examples/llmc-fsm-clip-rtn``, a third-party distribution, is built and installed the way a user installs it,
  found through its ``llmc_fsm`` entry point, and run by ``llmc_fsm.oneshot`` on a tiny random Llama; its weights,
  clipping choices and errors are checked against a float64 reference written here.
"""

from __future__ import annotations

import ast
import inspect
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import tiny_llama
import torch
from torch import nn

import llmc_fsm
import llmc_fsm.testing
import llmc_fsm.toolkit
from llmc_fsm.core import registry as registry_module
from llmc_fsm.core.registry import get_registry
from llmc_fsm.pipeline.sequential import run_sequential
from llmc_fsm.toolkit import CalibratedModifier

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "llmc-fsm-clip-rtn"
PLUGIN_SOURCES = sorted(p for p in (ROOT / "plugins").glob("*/llmc_fsm_*/**/*.py"))
EXAMPLE_SOURCES = sorted((EXAMPLE / "llmc_fsm_clip_rtn").glob("*.py"))

#: Public names per public module: what a plugin may import.
PUBLIC = {
    "llmc_fsm": set(llmc_fsm.__all__),
    "llmc_fsm.toolkit": set(llmc_fsm.toolkit.__all__),
    "llmc_fsm.testing": set(llmc_fsm.testing.__all__),
}


# --------------------------------------------------------------------------- only public names
def non_public_imports(source: str, filename: str) -> list[str]:
    """``"file:line: what"`` for every use of a non-public ``llmc_fsm`` name in ``source``.

    Checked: ``from M import N`` with ``M`` a public module and ``N`` in its ``__all__``; ``import M`` of a public
    module; reads ``llmc_fsm.N`` / ``llmc_fsm.toolkit.N`` / ``llmc_fsm.testing.N`` of public names. Any other
    ``llmc_fsm`` module (``llmc_fsm.toolkit.obs``, ``llmc_fsm.core.registry``, ...) is private.
    """
    found = []
    tree = ast.parse(source, filename)
    # only the longest attribute chain is checked: llmc_fsm.toolkit.obs.obs_sweep, not also llmc_fsm.toolkit.obs
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "llmc_fsm":
            if node.module not in PUBLIC:
                found.append(f"{where}: from {node.module} import ... (private module)")
                continue
            found += [
                f"{where}: from {node.module} import {a.name} (not in {node.module}.__all__)"
                for a in node.names
                if a.name not in PUBLIC[node.module] and f"{node.module}.{a.name}" not in PUBLIC
            ]
        elif isinstance(node, ast.Import):
            found += [
                f"{where}: import {a.name} (private module)"
                for a in node.names
                if a.name.split(".")[0] == "llmc_fsm" and a.name not in PUBLIC
            ]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is None or dotted.split(".")[0] != "llmc_fsm" or id(node) in inner:
                continue
            found += _check_dotted(dotted, where)
    return sorted(set(found), key=lambda line: (int(line.split(":")[1]) if line.split(":")[1].isdigit() else 0, line))


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _check_dotted(dotted: str, where: str) -> list[str]:
    """``llmc_fsm.X.Y...``: the longest public module prefix, then a name in its ``__all__``."""
    parts = dotted.split(".")
    module = "llmc_fsm"
    if len(parts) > 2 and f"llmc_fsm.{parts[1]}" in PUBLIC:
        module = f"llmc_fsm.{parts[1]}"
        name = parts[2]
    else:
        name = parts[1]
    if module == "llmc_fsm" and f"llmc_fsm.{name}" in PUBLIC:
        return []  # llmc_fsm.toolkit itself
    return [] if name in PUBLIC[module] else [f"{where}: {dotted} ({name} is not in {module}.__all__)"]


def _read(path: Path) -> tuple[str, str]:
    return path.read_text(encoding="utf-8"), str(path.relative_to(ROOT))


def test_plugin_sources_are_found():
    packages = {p.relative_to(ROOT / "plugins").parts[0] for p in PLUGIN_SOURCES}
    assert packages == {"pruning", "quantization", "training"}
    assert len(PLUGIN_SOURCES) >= 15
    assert [p.name for p in EXAMPLE_SOURCES] == ["__init__.py", "clipping.py", "modifier.py"]


@pytest.mark.parametrize("path", PLUGIN_SOURCES + EXAMPLE_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_import_only_public_llmc_fsm_names(path):
    assert non_public_imports(*_read(path)) == []


def test_the_import_check_names_every_private_use():
    source = (
        "import llmc_fsm\n"
        "import llmc_fsm.toolkit\n"
        "import llmc_fsm.core.registry\n"
        "from llmc_fsm import Modifier, hookimpl, toolkit\n"
        "from llmc_fsm import Modifier, Run\n"
        "from llmc_fsm.toolkit import obs_sweep, TRIM_EVERY_BYTES\n"
        "from llmc_fsm.toolkit.obs import obs_sweep\n"
        "from llmc_fsm_pruning.masks import nm_keep\n"
        "def f():\n"
        "    from llmc_fsm.toolkit.distributed import shard\n"
        "    return llmc_fsm.hookimpl, llmc_fsm.toolkit.CalibratedModifier, llmc_fsm.toolkit.obs.obs_sweep\n"
        "x = llmc_fsm.core.registry.get_registry()\n"
    )
    assert non_public_imports(source, "m.py") == [
        "m.py:3: import llmc_fsm.core.registry (private module)",
        "m.py:5: from llmc_fsm import Run (not in llmc_fsm.__all__)",
        "m.py:6: from llmc_fsm.toolkit import TRIM_EVERY_BYTES (not in llmc_fsm.toolkit.__all__)",
        "m.py:7: from llmc_fsm.toolkit.obs import ... (private module)",
        "m.py:10: from llmc_fsm.toolkit.distributed import ... (private module)",
        "m.py:11: llmc_fsm.toolkit.obs.obs_sweep (obs is not in llmc_fsm.toolkit.__all__)",
        "m.py:12: llmc_fsm.core.registry.get_registry (core is not in llmc_fsm.__all__)",
    ]


def test_every_public_toolkit_name_is_documented():
    docs = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    section = docs.split("## Writing a calibrated modifier", 1)[1]
    undocumented, unnamed = [], []
    for name in llmc_fsm.toolkit.__all__:
        obj = getattr(llmc_fsm.toolkit, name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not (
            obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        ):
            undocumented.append(name)
        if f"`{name}`" not in section:
            unnamed.append(name)
    assert undocumented == []
    assert unnamed == []
    assert llmc_fsm.toolkit.__doc__ is not None
    assert all(name in llmc_fsm.toolkit.__doc__ for name in llmc_fsm.toolkit.__all__)


# --------------------------------------------------------------------------- the example distribution
@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """The example built into a wheel and installed into a temporary directory, the way ``pip install`` does.

    Why this way: ``pip install --target`` builds the wheel (PEP 517, with the setuptools of this environment:
    ``--no-build-isolation``, so no network) and unpacks it with its ``*.dist-info`` (``entry_points.txt``) into a
    fresh directory. Putting that directory first on ``sys.path`` makes ``importlib.metadata`` — which the plugin
    registry reads — see a real installed distribution, while the environment itself is never changed: nothing to
    uninstall, no leftover in CI when a test fails, and it works whether or not the package was installed before.
    The source is copied first, so the build's ``build/`` and ``*.egg-info`` never land in the repository.
    """
    tmp = tmp_path_factory.mktemp("clip_rtn")
    source = shutil.copytree(EXAMPLE, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--disable-pip-version-check", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in site.iterdir() if not p.name.startswith("__")) == [
        "llmc_fsm_clip_rtn",
        "llmc_fsm_clip_rtn-0.1.0.dist-info",
    ]
    return site


@pytest.fixture
def clip_rtn(example_site, monkeypatch):
    """The installed example, importable and registered through its entry point (registry rebuilt, then restored)."""
    monkeypatch.syspath_prepend(str(example_site))
    monkeypatch.setattr(registry_module, "_REGISTRY", None)
    monkeypatch.delenv(registry_module.DISABLE_ENV, raising=False)
    yield get_registry()
    for name in [m for m in sys.modules if m.split(".")[0] == "llmc_fsm_clip_rtn"]:
        del sys.modules[name]


def test_the_example_is_discovered_through_its_entry_point(clip_rtn):
    info = clip_rtn.info("ClippedRTNModifier")
    assert info is not None
    assert (info.distribution, info.version, info.entry_point) == ("llmc-fsm-clip-rtn", "0.1.0", "clip_rtn")
    assert Path(sys.modules["llmc_fsm_clip_rtn"].__file__).is_relative_to(Path(sys.path[0]))
    assert [e for e in clip_rtn.errors if e.distribution == "llmc-fsm-clip-rtn"] == []
    assert issubclass(info.cls, CalibratedModifier)


# ---- float64 reference, written here independently of the example's code
BITS = 4
RATIOS = [1.0 - 0.05 * k for k in range(11)]  # the default grid: steps 11, min_ratio 0.5


def reference_round(w: torch.Tensor, ratio: float, bits: int = BITS) -> torch.Tensor:
    """One row ``w`` (float64 ``[in]``) on its symmetric grid clipped at ``ratio * max|w|``."""
    top = 2 ** (bits - 1) - 1
    step = ratio * float(w.abs().max()) / top
    if step == 0.0:
        return w.clone()
    return torch.tensor([step * min(max(round(float(v) / step), -top - 1), top) for v in w], dtype=torch.float64)


def reference_search(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Per row: the index of the first ratio with the least ``d H d``, and the rounded rows (float64)."""
    chosen, rows = [], []
    for w in weight.to(torch.float64):
        errors, rounded = [], []
        for r in RATIOS:
            q = reference_round(w, r)
            d = w - q
            errors.append(float(d @ hessian @ d))
            rounded.append(q)
        k = min(range(len(RATIOS)), key=lambda i: (errors[i], i))
        chosen.append(k)
        rows.append(rounded[k])
    return chosen, torch.stack(rows)


def output_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    d = w.to(torch.float64) - w_hat.to(torch.float64)
    return float(torch.einsum("oi,ij,oj->", d, hessian, d))


def test_search_picks_the_float64_reference_clipping_per_channel(clip_rtn):
    from llmc_fsm_clip_rtn import clip_ratios, search_clip_ratios

    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 24, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3.0, 24, dtype=torch.float64)
    hessian = 2.0 / 200 * x.T @ x
    weight = torch.randn(40, 24, generator=g) * 0.02
    weight[:, 5] *= 8  # outliers: clipping pays off for some rows
    assert clip_ratios(11, 0.5).tolist() == pytest.approx(RATIOS, abs=1e-15)
    found = search_clip_ratios(weight, hessian, bits=BITS, ratios=clip_ratios(11, 0.5))
    chosen, rows = reference_search(weight, hessian)
    assert found.index.tolist() == chosen
    assert 0 < sum(k > 0 for k in chosen) < 40  # some rows clipped, some not: the search decides
    torch.testing.assert_close(found.weight, rows, rtol=0, atol=1e-12)
    rtn = torch.stack([reference_round(w, 1.0) for w in weight.to(torch.float64)])
    assert output_error(weight, found.weight, hessian) < output_error(weight, rtn, hessian)


def test_search_refuses_bad_input_in_one_line(clip_rtn):
    from llmc_fsm_clip_rtn import ClippedRTNModifier, clip_ratios, search_clip_ratios

    w, h = torch.zeros(4, 3), torch.eye(3)
    with pytest.raises(ValueError, match=r"^weight \[out, in\] and hessian \[in, in\] do not fit: \(4, 3\), \(4, 4\)$"):
        search_clip_ratios(w, torch.eye(4), bits=4, ratios=clip_ratios(3, 0.5))
    with pytest.raises(ValueError, match=r"^ratios must be numbers in \(0, 1\] including 1.0, got \[0.9, 0.8\]$"):
        search_clip_ratios(w, h, bits=4, ratios=torch.tensor([0.9, 0.8], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^bits must be an int from 2 to 8, got 9$"):
        search_clip_ratios(w, h, bits=9, ratios=clip_ratios(3, 0.5))
    with pytest.raises(ValueError, match=r"^min_ratio must be a number in \(0, 1\], got 0$"):
        clip_ratios(3, 0)
    with pytest.raises(ValueError, match=r"^bits must be an int from 2 to 8, got 1$"):
        ClippedRTNModifier(bits=1)
    with pytest.raises(ValueError, match=r"^min_ratio must be a number in \(0, 1\], got 1.5$"):
        ClippedRTNModifier(min_ratio=1.5)


class _RawInputs:
    """Every calibration input row a target received, float64 (the reference's own statistic)."""

    def __init__(self, in_features: int) -> None:
        self.in_features = in_features
        self.rows: list[torch.Tensor] = []

    def add_batch(self, x: torch.Tensor) -> None:
        self.rows.append(x.detach().reshape(-1, self.in_features).to(torch.float64).clone())

    @property
    def num_samples(self) -> int:
        return sum(r.shape[0] for r in self.rows)


#: module name -> float64 [n, in] inputs, filled by _InputRecorder during the one-shot run.
RECORDED: dict[str, torch.Tensor] = {}


@attrs.define(kw_only=True, slots=False, eq=False)
class _InputRecorder(CalibratedModifier):
    """Test helper: records, in float64, exactly the calibration inputs a ``CalibratedModifier`` receives for each
    target (its hooks stop at each target's compression, like every calibrated modifier's); changes no weight."""

    def _new_accumulator(self, module: nn.Module) -> _RawInputs:
        return _RawInputs(module.weight.shape[1])

    def _compress_group(self, modules: list[nn.Module], accumulator: _RawInputs) -> list[torch.Tensor]:
        names = {id(m): n for n, m in self.resolved_targets.items()}
        for module in modules:
            RECORDED[names[id(module)]] = torch.cat(accumulator.rows)
        return [module.weight.detach().clone() for module in modules]


def test_clipped_rtn_through_oneshot_matches_the_float64_reference(clip_rtn, tmp_path):
    clip_rtn.register(_InputRecorder)
    RECORDED.clear()
    model = tiny_llama.llama(vocab=96, hidden=32, heads=2, kv_heads=1, positions=64)
    data = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(0))
    before = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    recipe = {"quant_stage": {"_InputRecorder": {}, "ClippedRTNModifier": {"bits": BITS}}}
    out = llmc_fsm.oneshot(model=model, recipe=recipe, dataset=data, output_dir=tmp_path / "o", progress=False)

    targets = [n for n in before if n != "lm_head"]
    assert sorted(RECORDED) == sorted(targets) and len(targets) == 14
    assert torch.equal(out.lm_head.weight, before["lm_head"])
    report = {m.name: m for m in out.llmc_fsm_report.modules}
    clipped_channels, lower_error = 0, 0
    for name in targets:
        x = RECORDED[name]
        assert x.shape[0] == 8 * 16  # every calibration token, once
        hessian = 2.0 / x.shape[0] * x.T @ x
        weight, final = before[name].to(torch.float64), dict(out.named_modules())[name].weight.detach()
        chosen, expected = reference_search(weight, hessian)
        torch.testing.assert_close(final.to(torch.float64), expected, rtol=1e-6, atol=1e-9, msg=name)
        assert max(len(torch.unique(row)) for row in final) <= 2**BITS, name
        rtn = torch.stack([reference_round(w, 1.0) for w in weight])
        err, err_rtn = output_error(weight, final, hessian), output_error(weight, rtn, hessian)
        assert err <= err_rtn, name
        lower_error += err < err_rtn
        clipped_channels += sum(k > 0 for k in chosen)
        entry = report[name]
        assert entry.bits == BITS and entry.group_size is None and entry.zeros == 0
        (label, rel), *_ = [(lbl, e) for lbl, e in entry.rel_output_errors if lbl.startswith("ClippedRTNModifier")]
        assert label == "ClippedRTNModifier (quant_stage)"
        assert rel == pytest.approx((err / float(torch.einsum("oi,ij,oj->", weight, hessian, weight))) ** 0.5, rel=1e-4)
    # the search clipped channels, and it paid off in every module (on this seed: 412 of 512 channels clipped,
    # squared output error 0.42-0.80 of plain RTN's; the best ratio beat the second by >= 4e-5 relative, far above
    # the float32 Hessian's rounding, so the modifier and the float64 reference cannot disagree on a near-tie)
    assert clipped_channels > 0 and lower_error == len(targets)


def test_clipped_rtn_obeys_the_lifecycle_contract(clip_rtn):
    from llmc_fsm_clip_rtn import ClippedRTNModifier

    from llmc_fsm.testing import check_modifier

    def state():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        return {"model": model, "calibration_data": torch.randn(4, 8)}

    check_modifier(lambda: ClippedRTNModifier(bits=4), state, max_examples=25, modules_factory=lambda s: [s["model"]])


@attrs.define(kw_only=True, slots=False, eq=False)
class _Broadcaster(CalibratedModifier):
    """Returns ``returned(weight)`` from ``_compress_group`` (a plugin author's slip)."""

    returned: Any = None

    def _new_accumulator(self, module: nn.Module) -> _RawInputs:
        return _RawInputs(module.weight.shape[1])

    def _compress_group(self, modules: list[nn.Module], accumulator: _RawInputs) -> list[torch.Tensor]:
        return [self.returned(module.weight) for module in modules]


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda w: w[:1] * 0.5, "returned (1, 32) for model.layers.0.self_attn.q_proj, whose weight is (32, 32): it "
                                "must return one tensor of each module's weight shape; none of them was changed"),
        (lambda w: torch.tensor(0.0), "returned () for model.layers.0.self_attn.q_proj, whose weight is (32, 32)"),
        (lambda w: w * float("nan"), "returned NaN or Inf values for model.layers.0.self_attn.q_proj; none of them "
                                     "was changed"),
    ],
)
def test_a_compress_group_returning_the_wrong_shape_or_nan_is_refused_before_the_copy(returned, message):
    """B4's cases (session 31): a row or a scalar was broadcast into every row of every target by copy_ and the run
    saved (exit 0); a NaN surfaced one group later as that group's NaN calibration inputs."""
    model = tiny_llama.llama(vocab=96, hidden=32, heads=2, kv_heads=1, positions=64)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    session = llmc_fsm.Session([_Broadcaster(returned=returned)])
    session.initialize(model=model, calibration_data=torch.randint(0, 96, (4, 16)))
    with pytest.raises(llmc_fsm.ModifierError) as info:
        run_sequential(session, batch_size=4, progress=False)
    assert type(info.value.__cause__) is ValueError
    assert str(info.value.__cause__).startswith(f"_Broadcaster._compress_group {message}")
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)
