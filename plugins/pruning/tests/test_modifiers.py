"""SparseGPTModifier / WandaPruningModifier on small torch models (no transformers needed)."""

from __future__ import annotations

import pytest
import torch
from llmc_fsm_pruning import MagnitudePruningModifier, SparseGPTModifier, WandaPruningModifier
from torch import nn

from llmc_fsm import MissingStateError, ModifierError, RecipeError, Session
from llmc_fsm.pipeline.sequential import run_sequential


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, 2 * width)
        self.b = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Toy(nn.Module):
    """Embedding -> blocks -> head tied to the embedding."""

    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def toy() -> Toy:
    torch.manual_seed(0)
    return Toy().eval()


DATA = torch.randint(0, 32, (6, 12), generator=torch.Generator().manual_seed(0))


def test_registered_through_the_entry_point():
    from llmc_fsm.core.registry import get_registry

    registry = get_registry()
    for name in ("SparseGPTModifier", "WandaPruningModifier", "MagnitudePruningModifier", "ConstantPruningModifier"):
        assert name in registry.classes
        assert registry.distributions[name][0] == "llmc-fsm-pruning"


@pytest.mark.parametrize("cls", [SparseGPTModifier, WandaPruningModifier])
def test_declares_model_and_calibration_data(cls):
    assert cls.required_state == frozenset({"model", "calibration_data"})
    with pytest.raises(MissingStateError, match=rf"\n  - {cls.__name__} requires 'calibration_data'\n"):
        Session([cls()]).initialize(model=toy())


@pytest.mark.parametrize("cls", [SparseGPTModifier, WandaPruningModifier])
def test_prunes_exactly_and_leaves_tied_head_and_embedding(cls):
    model = toy()
    embed = model.embed.weight.clone()
    session = Session([cls(sparsity=0.25, ignore=["head"])])
    session.initialize(model=model, calibration_data=DATA)
    run_sequential(session, batch_size=4, progress=False)
    session.finalize()
    for layer in model.layers:
        for lin in (layer.a, layer.b):
            assert int((lin.weight == 0).sum()) == lin.weight.numel() // 4
    assert torch.equal(model.embed.weight, embed)
    mod = session.modifiers[0]
    assert sorted(mod.results) == ["layers.0.a", "layers.0.b", "layers.1.a", "layers.1.b"]
    assert all(r.sparsity == 0.25 and r.samples == DATA.numel() for r in mod.results.values())
    assert mod.num_hooks == 0


def test_regex_targets_and_ignore():
    model = toy()
    session = Session([SparseGPTModifier(targets=["re:layers\\.\\d+\\.a"], ignore=["head", "layers.1.a"])])
    session.initialize(model=model, calibration_data=DATA)
    run_sequential(session, progress=False)
    session.finalize()
    assert list(session.modifiers[0].results) == ["layers.0.a"]
    assert int((model.layers[1].a.weight == 0).sum()) == 0


def test_unknown_targets_error_lists_module_names():
    with pytest.raises(ModifierError, match=r"'Conv1d': it matches no module\).*Linear-like modules: layers\.0\.a, "):
        Session([WandaPruningModifier(targets=["Conv1d"])]).initialize(model=toy(), calibration_data=DATA)


def test_non_linear_target_is_refused():
    msg = r"'Embedding': it matches only modules that are not Linear-like \(no 2-D weight with in_features\): embed \(Embedding\)"
    with pytest.raises(ModifierError, match=msg):
        Session([WandaPruningModifier(targets=["Embedding"], ignore=[])]).initialize(
            model=toy(), calibration_data=DATA
        )


_SPARSITY = r"sparsity must be a number in \[0, 1\) \(fraction of weights set to zero\), got "


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"sparsity": 1.0}, _SPARSITY + "1.0$"),
        ({"sparsity": "half"}, _SPARSITY + "'half'$"),
        ({"sparsity": True}, _SPARSITY + "True$"),
        (
            {"mask_structure": "2-4"},
            r"argument 'mask_structure': invalid mask_structure '2-4': expected 'unstructured' "
            r"\(alias '0:0'\) or 'N:M' with integers 0 < N < M",
        ),
        (
            {"targets": []},
            r"argument 'targets': targets must name at least one module pattern, e.g. \['Linear'\]$",
        ),
        (
            {"targets": [3]},
            r"argument 'targets': TypeError: must be a module pattern or a list of them \(class name, full name or "
            r"'re:<regex>'\), got \[3\]$",
        ),
    ],
)
def test_bad_recipe_arguments(args, message):
    with pytest.raises(RecipeError, match=r"^recipe <dict>, stage 's', modifier WandaPruningModifier, ") as info:
        Session({"s": {"WandaPruningModifier": args}})
    assert info.match(message)


def test_target_without_input_is_left_dense_and_reported():
    model = toy()
    session = Session([SparseGPTModifier(ignore=["head"])])
    session.initialize(model=model, calibration_data=DATA)
    session.calibration_start()
    session.calibration_end()  # no forward pass at all
    session.finalize()
    mod = session.modifiers[0]
    assert mod.results == {}
    assert sorted(mod.skipped) == ["layers.0.a", "layers.0.b", "layers.1.a", "layers.1.b"]
    assert int((model.layers[0].a.weight == 0).sum()) == 0


def test_nm_with_block_size_not_multiple_of_m():
    with pytest.raises(ValueError, match="multiple of M=4"):
        SparseGPTModifier(mask_structure="2:4", block_size=6)


def test_a_sparsity_an_n_m_structure_overrides_is_said(caplog):
    """With an N:M mask_structure the sparsity argument is not used (the structure fixes it), here as in
    llm-compressor: a recipe's 0.7 with 2:4 pruned 50% without a word (a tester's case). One warning when the recipe
    gives a sparsity the structure does not make; none for the default or an agreeing one."""
    with caplog.at_level("WARNING", logger="llmc_fsm_pruning.masks"):
        SparseGPTModifier(mask_structure="2:4")
        SparseGPTModifier(sparsity=0.5, mask_structure="4:8")
        SparseGPTModifier(sparsity=0.7)
        assert caplog.records == []
        SparseGPTModifier(sparsity=0.7, mask_structure="2:4")
        WandaPruningModifier(sparsity="0.6", mask_structure="8:16")
    assert [r.getMessage() for r in caplog.records] == [
        "SparseGPTModifier: sparsity 0.7 is not used: mask_structure '2:4' fixes the sparsity (50% of each group of 4)",
        "WandaPruningModifier: sparsity 0.6 is not used: mask_structure '8:16' fixes the sparsity (50% of each group "
        "of 16)",
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="llmc_fsm_pruning.masks"), pytest.raises(ValueError, match="contradicts"):
        MagnitudePruningModifier(sparsity=0.7, mask_structure="2:4")  # refused, so no warning first (B4's case)
    assert caplog.records == []


def test_an_unquoted_n_m_read_as_base_60_and_a_percentage_sparsity_say_what_was_meant() -> None:
    """YAML 1.1 reads an unquoted 2:4 as 124; a newcomer read 'invalid mask_structure 124' as nonsense. 50 as a
    sparsity is 50%."""
    from llmc_fsm_pruning.masks import parse_mask_structure

    with pytest.raises(ValueError) as info:
        parse_mask_structure(124)
    assert str(info.value).startswith(
        "invalid mask_structure 124 (YAML read an unquoted 2:4 as the base-60 number 124: quote it, \"2:4\"): ")
    for plain in (61, 5):  # 1:1 is no N:M with N < M; YAML reads 0:5 as a string, not 5: no hint
        with pytest.raises(ValueError) as info:
            parse_mask_structure(plain)
        assert str(info.value).startswith(f"invalid mask_structure {plain}: ")
    with pytest.raises(ValueError) as info:
        SparseGPTModifier(sparsity=50)
    assert str(info.value) == (
        "sparsity must be a number in [0, 1) (fraction of weights set to zero), got 50 (a percentage? 50% is 0.5)")


@pytest.mark.parametrize("value", [[0.3, 0.7], {0.3: ["re:.*layers.0.*"]}])
def test_a_per_layer_sparsity_says_llm_compressor_s_form_is_not_supported_and_what_to_write(value):
    """A per-layer sparsity list or mapping (llm-compressor's form) was refused as "must be a number in [0, 1)",
    which did not say the form is unsupported nor how to prune layers to different sparsities (found by a tester)."""
    with pytest.raises(ValueError) as info:
        WandaPruningModifier(sparsity=value)
    assert str(info.value) == (
        f"sparsity {value!r}: llm-compressor's per-layer form (a list matched to the targets, or a mapping) is not "
        "supported here; give one number in [0, 1) per modifier, and for several sparsities one modifier per "
        "sparsity with the layers it prunes as its targets (a stage in list form may hold the same modifier several "
        "times: - WandaPruningModifier: {sparsity: 0.3, targets: [...]})"
    )
    recipe = "s:\n  - WandaPruningModifier: {sparsity: 0.3, targets: [a]}\n  - WandaPruningModifier: {sparsity: 0.7}\n"
    assert [m.sparsity for m in Session(recipe).modifiers] == [0.3, 0.7]  # the form the message gives runs


def test_a_one_shot_modifier_given_a_start_is_told_to_drop_its_schedule() -> None:
    """SparseGPTModifier with start: 0 in one-shot (llm-compressor's oneshot runs it, ignoring start) was refused as
    "such a modifier acts during training", which it does not (found by a tester): the refusal now says the schedule
    is what needs steps_per_epoch, and to remove it."""
    import llmc_fsm

    data = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(MissingStateError) as info:
        llmc_fsm.oneshot(model=toy(), recipe={"s": {"SparseGPTModifier": {"start": 0}}}, dataset=data, progress=False)
    assert str(info.value) == (
        "SparseGPTModifier: start/end/update are a training schedule counted in epochs (steps_per_epoch, which "
        "one-shot does not give), and this modifier compresses once from calibration data: remove them to run it in "
        "one-shot (llm-compressor's oneshot ignores them)")
