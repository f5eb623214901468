"""Recipe edges: pydantic objects written to YAML, llm-compressor modifiers we lack, ``oneshot --block-size``."""

from __future__ import annotations

from typing import Any

import attrs
import pydantic
import pytest
import tiny_llama
import yaml

from llmc_fsm import Modifier, RecipeError
from llmc_fsm.cli import main
from llmc_fsm.core import registry as plugins_mod
from llmc_fsm.core.registry import ModifierRegistry, get_registry
from llmc_fsm.recipes.building import resolve_recipe
from llmc_fsm.recipes.model import Recipe, Stage


# --------------------------------------------------------------------------- pydantic models as arguments
class Args(pydantic.BaseModel):
    bits: int
    group: int | None = None
    note: str = "default"


@attrs.define(kw_only=True, slots=False, eq=False)
class WithModel(Modifier):
    """Test modifier whose ``spec`` may hold a pydantic model."""

    spec: Any = None


@pytest.fixture
def with_model(monkeypatch: pytest.MonkeyPatch) -> ModifierRegistry:
    reg = ModifierRegistry()  # no entry points: isolated from installed plugins
    reg.register(WithModel)
    monkeypatch.setattr(plugins_mod, "_REGISTRY", reg)
    return reg


def test_a_pydantic_model_is_written_as_the_mapping_of_its_given_fields(with_model) -> None:
    recipe = Recipe([Stage("s", [WithModel(spec={"inner": Args(bits=4), "list": [Args(bits=8, group=32)]})])])
    assert recipe.to_dict()["s"]["modifiers"] == [
        {"WithModel": {"spec": {"inner": {"bits": 4}, "list": [{"bits": 8, "group": 32}]}}}
    ]
    (read_back,) = resolve_recipe(recipe.to_yaml()).modifiers
    assert read_back.spec == {"inner": {"bits": 4}, "list": [{"bits": 8, "group": 32}]}
    assert Args.model_validate(read_back.spec["inner"]) == Args(bits=4)


def test_an_object_that_is_not_plain_data_is_still_refused(with_model) -> None:
    recipe = Recipe([Stage("s", [WithModel(spec=object())])])
    with pytest.raises(RecipeError) as info:
        recipe.to_yaml()
    assert (
        str(info.value) == "stage 's', modifier WithModel, argument 'spec': a object cannot be written to a YAML recipe"
    )


# --------------------------------------------------------------------------- llm-compressor modifiers we lack
def _known() -> str:
    return ", ".join(sorted(get_registry().classes))


@pytest.mark.parametrize(
    ("name", "what"),
    [
        (
            "QuIPModifier",
            "QuIP-style Hadamard rotations of every Linear's input at run time, which transformers does not apply "
            "when it loads a compressed-tensors checkpoint; SpinQuantModifier fuses R1/R2 rotations into the weights "
            "instead",
        ),
    ],
)
def test_llmcompressor_modifiers_we_lack_are_named_as_such(name: str, what: str) -> None:
    text = f"smoothing_stage:\n  smoothing_modifiers:\n    {name}:\n      smoothing_strength: 0.8\n"
    with pytest.raises(RecipeError) as info:
        resolve_recipe(text)
    assert str(info.value) == (
        f"recipe <text>, line 3, stage 'smoothing_stage': unknown modifier {name!r}. {name} is an llm-compressor "
        f"modifier that llmc-fsm does not implement ({what}); remove it from the recipe or use llm-compressor for it. "
        f"Known modifiers: {_known()}."
    )


def test_other_unknown_modifiers_keep_the_suggestion() -> None:
    with pytest.raises(RecipeError) as info:
        resolve_recipe({"s": {"SparseGPTModifer": {}}})
    assert str(info.value) == (
        f"recipe <dict>, stage 's': unknown modifier 'SparseGPTModifer'. Did you mean 'SparseGPTModifier'? "
        f"Known modifiers: {_known()}."
    )


# --------------------------------------------------------------------------- oneshot --block-size
def _cli(capsys, *args: str) -> tuple[int, str]:
    try:
        rc = main(["oneshot", "--no-progress", *args])
    except SystemExit as exc:  # a usage error (argparse's, or flags that do not go together): status 2
        rc = exc.code
    return rc, capsys.readouterr().err


def test_block_size_flag_reaches_the_gptq_recipe(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    argv = tiny_llama.oneshot_argv(*tiny_model_dir, out, "--num-samples", "4", "--method", "gptq")
    assert main([*argv, "--group-size", "32", "--block-size", "32"]) == 0
    capsys.readouterr()
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    gptq = saved["quantization_stage"]["modifiers"][0]["GPTQModifier"]
    assert (gptq["block_size"], gptq["scheme"]) == (32, {"preset": "W4A16", "weights": {"group_size": 32}})


GROUP_48 = (
    "must divide one another: use a group size that divides 128 and every targeted layer's input wid"
    "th (e.g. CLI: --group-size 64; recipe: group_size: 64), or, only if every targeted layer's inpu"
    't width is a multiple of 48, a block_size that is a multiple of it (CLI: --block-size 48; recip'
    'e: block_size: 48)'
)


def test_group_size_that_does_not_fit_the_block_names_the_flag(tiny_model_dir, tmp_path, capsys) -> None:
    model_dir, _ = tiny_model_dir
    rc, err = _cli(
        capsys, "--model", str(model_dir), "--method", "gptq", "--group-size", "48", "--output", str(tmp_path / "out")
    )
    assert rc == 1
    assert err == (
        "llmc-fsm oneshot: error: recipe generated from --method gptq --group-size 48, stage 'quantization_stage', "
        "modifier GPTQModifier: group_size 48 and GPTQ's "
        "block_size 128 (columns per lazy update) " + GROUP_48 + "\n"
    )
    assert list(tmp_path.iterdir()) == []


_USAGE = "; see 'llmc-fsm oneshot --help'"  # flags that do not go together: a usage error (status 2)


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (
            ["--method", "rtn", "--block-size", "64"],
            2,
            "--block-size applies to --method gptq or sparsegpt only (--method rtn has no block size)" + _USAGE,
        ),
        (
            ["--method", "wanda", "--block-size", "64"],
            2,
            "--block-size applies to --method gptq or sparsegpt only (--method wanda has no block size)" + _USAGE,
        ),
        (["--method", "gptq", "--block-size", "0"], 1, "--block-size must be a positive int, got 0"),
        (
            ["--recipe", "r.yaml", "--block-size", "64"],
            2,
            "--recipe cannot be combined with --method/--sparsity/"
            "--mask-structure/--scheme/--group-size/--block-size/--observer; put them in the recipe" + _USAGE,
        ),
    ],
)
def test_block_size_refusals(tmp_path, capsys, args: list[str], status: int, message: str) -> None:
    rc, err = _cli(capsys, *args, "--output", str(tmp_path / "out"))
    assert (rc, err) == (status, f"llmc-fsm oneshot: error: {message}\n")
    assert list(tmp_path.iterdir()) == []


def test_block_size_flag_reaches_sparsegpt() -> None:
    from llmc_fsm.oneshot_job.settings import RecipeFlags

    recipe = RecipeFlags(method="sparsegpt", mask_structure="2:4", block_size=64).recipe()
    assert recipe.source == "generated from --method sparsegpt --mask-structure 2:4 --block-size 64"
    (modifier,) = recipe.modifiers
    assert (type(modifier).__name__, modifier.block_size, modifier.mask_structure) == ("SparseGPTModifier", 64, "2:4")


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_key_twice_in_a_json_recipe_is_refused_as_in_yaml(tmp_path, suffix) -> None:
    """JSON text (a .json file, or JSON in a .yaml file) fell back to json.loads after YAML refused the duplicate:
    the last value won silently (``sparsity`` 0.7 over 0.5; a stage dropped)."""
    path = tmp_path / f"dup{suffix}"
    path.write_text('{"prune": {"SparseGPTModifier": {"sparsity": 0.5, "sparsity": 0.7}}}\n')
    with pytest.raises(RecipeError) as info:
        resolve_recipe(str(path))
    assert str(info.value) == (
        f"recipe {path}: found duplicate key 'sparsity' in a JSON object; every key must be unique"
    )


def test_a_plain_text_file_given_as_recipe_is_named_as_such(tmp_path) -> None:
    """A data file given as the recipe: the line quoted the whole file and said the file did not exist."""
    path = tmp_path / "cal.txt"
    path.write_text("w1 w2 w3 " * 5000)
    with pytest.raises(RecipeError) as info:
        resolve_recipe(str(path))
    assert str(info.value) == (
        f"recipe {path}: the top level must map stage names to modifiers, got str (the file holds plain text, not a "
        "YAML or JSON mapping of stages)"
    )


def test_integral_floats_for_int_arguments_are_read_as_llm_compressor_reads_them() -> None:
    """``block_size: 128.0`` / ``iters: 200.0`` / ``n_grid: 20.0``: llm-compressor's pydantic arguments take them as
    ints; they were refused here ("block_size must be a positive int, got 128.0"; found by a tester). A float with a
    fraction is still refused."""
    text = (
        "s:\n  GPTQModifier: {scheme: W4A16, block_size: 128.0}\n"
        "t:\n  AWQModifier: {n_grid: 20.0}\n  QuantizationModifier: {scheme: W4A16}\n"
        "u:\n  AutoRoundModifier: {scheme: W4A16, iters: 200.0}\n"
    )
    gptq, awq, _, autoround = resolve_recipe(text).modifiers
    assert (gptq.block_size, awq.n_grid, autoround.iters) == (128, 20, 200)
    assert {type(gptq.block_size), type(awq.n_grid), type(autoround.iters)} == {int}
    with pytest.raises(RecipeError, match=r"block_size must be a positive int, got 128\.5"):
        resolve_recipe("s:\n  GPTQModifier: {scheme: W4A16, block_size: 128.5}\n")
    with pytest.raises(RecipeError, match=r"block_size must be a positive int, got 1e\+300"):  # not a 301-digit int
        resolve_recipe("s:\n  GPTQModifier: {scheme: W4A16, block_size: 1.0e+300}\n")


def test_numpy_numbers_are_read_as_the_python_ones() -> None:
    """A script's ``np.int64(128)`` / ``np.float32(0.01)`` (llm-compressor's pydantic takes them; refused here before,
    found by a tester), and numpy epochs."""
    import numpy as np

    from llmc_fsm_pruning import MagnitudePruningModifier
    from llmc_fsm_quantization import GPTQModifier

    gptq = GPTQModifier(scheme="W4A16", block_size=np.int64(128), dampening_frac=np.float32(0.25))
    assert (gptq.block_size, gptq.dampening_frac) == (128, 0.25)
    assert (type(gptq.block_size), type(gptq.dampening_frac)) == (int, float)
    assert MagnitudePruningModifier(sparsity=0.5, start=np.int64(2)).start == 2.0
    # np.float64 is a float subclass YAML cannot write: it was kept, and the run crashed saving its recipe.yaml
    gptq = GPTQModifier(scheme="W4A16", block_size=np.float32(128.0), dampening_frac=np.float64(0.5))
    assert (type(gptq.block_size), type(gptq.dampening_frac)) == (int, float)
    assert "dampening_frac: 0.5" in resolve_recipe([gptq]).to_yaml()
    from llmc_fsm_pruning import SparseGPTModifier

    # an int no float holds, for a float argument: refused as inf (it was a bare OverflowError; a tester's case)
    with pytest.raises(ValueError, match=r"sparsity must be a number in \[0, 1\) .*got inf$"):
        SparseGPTModifier(sparsity=10**400)
    with pytest.raises(ValueError, match=r"^must be a finite number of epochs or null, got inf$"):
        MagnitudePruningModifier(sparsity=0.5, start=10**400)
    from fractions import Fraction

    with pytest.raises(ValueError, match=r"sparsity must be a number in \[0, 1\) .*got inf$"):
        SparseGPTModifier(sparsity=Fraction(10**400, 1))
    # numpy bools for flags (llm-compressor's pydantic takes them; refused here before: a tester's case)
    GPTQModifier(scheme="W4A16", offload_hessians=np.False_)  # an llm-compressor flag taken as True/False only
    sparsegpt = SparseGPTModifier(sparsity=0.5, preserve_sparsity_mask=np.True_)
    assert sparsegpt.preserve_sparsity_mask is True
    from llmc_fsm.oneshot_job.llmcompressor_args import check_llmcompressor_args

    assert check_llmcompressor_args({"save_compressed": np.True_, "trust_remote_code_model": np.False_}, []) == {}
    assert check_llmcompressor_args({"sequential_targets_per_subgraph": np.int64(1)}, []) == {}  # any numpy scalar
    gptq = GPTQModifier(scheme="W4A16", actorder=np.str_("static"))  # kept as np.str_ before (llm-compressor: str)
    assert type(gptq.actorder) is str and gptq.actorder == "static"
    gptq = GPTQModifier(scheme="W4A16", block_size=np.str_("128"), dampening_frac=np.array("0.05"))  # as "128" is
    assert (gptq.block_size, gptq.dampening_frac) == (128, 0.05)


def test_numpy_values_inside_arguments_are_written_as_the_python_ones(with_model) -> None:
    """``np.str_("Linear")`` in ``targets`` / ``ignore`` (a str subclass) and numpy numbers inside a mapping
    (``config_groups``): YAML's safe writer refused them when recipe.yaml was saved, after the work (a
    RepresenterError; a tester's case), or the recipe was refused ("a int64 cannot be written")."""
    import enum

    import numpy as np

    class Strategy(str, enum.Enum):
        GROUP = "group"

    spec = {"targets": [np.str_("Linear")], "bits": np.int64(4), "on": np.bool_(True), "frac": np.float32(0.5),
            "strategy": Strategy.GROUP, "ratio": np.float64(0.25), "nested": {"k": np.array(3)}}
    recipe = Recipe([Stage("s", [WithModel(spec=spec)])])
    written = recipe.to_dict()["s"]["modifiers"][0]["WithModel"]["spec"]
    assert written == {"targets": ["Linear"], "bits": 4, "on": True, "frac": 0.5, "strategy": "group", "ratio": 0.25,
                       "nested": {"k": 3}}
    assert [type(v) for v in (written["targets"][0], written["bits"], written["on"], written["frac"],
                              written["strategy"], written["ratio"], written["nested"]["k"])] == (
        [str, int, bool, float, str, float, int]
    )
    (read_back,) = resolve_recipe(recipe.to_yaml()).modifiers
    assert read_back.spec == written


def test_the_dtype_flags_take_oneshots_spellings() -> None:
    """``model-free --dtype bf16`` and ``explain --dtype bf16`` were refused where ``oneshot --dtype bf16`` runs."""
    from llmc_fsm.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["model-free", "m", "--scheme", "W8A8", "--output", "o", "--dtype", "bf16"]).dtype == (
        "bfloat16"
    )
    assert parser.parse_args(["explain", "r.yaml", "--dtype", "fp16"]).dtype == "float16"


def test_numbers_written_as_strings_are_read_as_llm_compressor_reads_them() -> None:
    """YAML 1.1 reads ``5e-1`` as a string, and recipes quote numbers: llm-compressor's pydantic arguments take
    them as numbers; they were refused ("sparsity must be a number ..., got '5e-1'"). A string of a non-integral value
    for an int argument, and a word, are still refused."""
    recipe = resolve_recipe("s:\n  SparseGPTModifier: {sparsity: 5e-1, block_size: '128', dampening_frac: '1e-2'}\n")
    modifier = recipe.modifiers[0]
    assert (modifier.sparsity, modifier.block_size, modifier.dampening_frac) == (0.5, 128, 0.01)
    assert type(modifier.block_size) is int
    assert resolve_recipe("s:\n  SparseGPTModifier: {sparsity: 0.5, block_size: '64.0'}\n").modifiers[0].block_size == 64
    with pytest.raises(RecipeError, match=r"block_size must be a positive int, got '12\.7'"):
        resolve_recipe("s:\n  SparseGPTModifier: {sparsity: 0.5, block_size: '12.7'}\n")
    with pytest.raises(RecipeError, match=r"sparsity must be a number in \[0, 1\).*got 'half'"):
        resolve_recipe("s:\n  SparseGPTModifier: {sparsity: half}\n")
