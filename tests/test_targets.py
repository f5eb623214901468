"""Target selection (llmc_fsm.toolkit.targets): llm-compressor's matching rules, containers, ignore, tied weights.

Issue 11 cases 9 (a regex that also matches containers), 10 (an ignore pattern
that matches nothing) and 11 (a target tied to the embedding).
"""

from __future__ import annotations

import logging

import pytest
import tiny_llama
import torch
import transformers
from compressed_tensors.utils.match import is_match
from tiny_llama import LINEARS
from torch import nn

from llmc_fsm.toolkit.targets import (
    TargetSelection,
    compact_names,
    is_linear_like,
    matches,
    resolve_targets,
    select_targets,
)


def llama(tied: bool = True, layers: int = 2) -> transformers.LlamaForCausalLM:
    return tiny_llama.llama(vocab=64, hidden=16, layers=layers, heads=2, kv_heads=1, positions=2048, tied=tied)


def linears(layer: int, *parts: str) -> list[str]:
    return [f"model.layers.{layer}.{p}" for p in (parts or LINEARS)]


# --- case 9: containers -------------------------------------------------------------------------


def test_regex_that_also_matches_containers_selects_only_linear_weights():
    model = llama()
    selection = select_targets(model, ["re:.*mlp.*"], ["lm_head"])
    mlp = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert list(selection.selected) == [*linears(0, *mlp), *linears(1, *mlp)]
    assert all(type(m) is nn.Linear for m in selection.selected.values())
    assert selection.selected_by == dict.fromkeys(selection.selected, "re:.*mlp.*")
    assert selection.ignored == {}
    assert selection.unmatched_targets == {}
    assert selection.unmatched_ignore == ()


def test_a_container_selects_the_linear_modules_inside_it():
    model = llama()
    # llm-compressor's classic SparseGPT target: the decoder layers themselves
    selection = select_targets(model, ["re:model.layers.\\d*$"], ["lm_head"])
    assert list(selection.selected) == [*linears(0), *linears(1)]
    # an ignored container ignores everything inside it, and says by which pattern
    selection = select_targets(model, ["LlamaDecoderLayer"], ["model.layers.0"])
    assert list(selection.selected) == linears(1)
    assert selection.ignored == dict.fromkeys(linears(0), "model.layers.0")


def test_patterns_that_select_nothing_are_named_with_the_reason(caplog: pytest.LogCaptureFixture):
    model = llama()
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.targets"):
        selected = resolve_targets(model, ["re:.*q_proj$", "LlamaRMSNorm", "re:.*nothing"], ["lm_head"])
    assert list(selected) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert [r.getMessage() for r in caplog.records] == [
        "target pattern 'LlamaRMSNorm' selects nothing: it matches only modules that are not Linear-like (no 2-D weight with in_features): "
        "model.layers.0.input_layernorm (LlamaRMSNorm), model.layers.0.post_attention_layernorm (LlamaRMSNorm), "
        "model.layers.1.input_layernorm (LlamaRMSNorm), model.layers.1.post_attention_layernorm (LlamaRMSNorm) "
        "and 1 more",
        "target pattern 're:.*nothing' selects nothing: it matches no module",
    ]


def test_targets_that_all_select_nothing_are_an_error():
    with pytest.raises(ValueError) as info:
        select_targets(llama(), ["Embedding", "re:.*norm$"], [])
    assert str(info.value) == (
        "targets ['Embedding', 're:.*norm$'] select no module with a Linear-like weight in LlamaForCausalLM "
        "('Embedding': it matches only modules that are not Linear-like (no 2-D weight with in_features): model.embed_tokens (Embedding); "
        "'re:.*norm$': it matches only modules that are not Linear-like (no 2-D weight with in_features): model.layers.0.input_layernorm "
        "(LlamaRMSNorm), model.layers.0.post_attention_layernorm (LlamaRMSNorm), model.layers.1.input_layernorm "
        "(LlamaRMSNorm), model.layers.1.post_attention_layernorm (LlamaRMSNorm) and 1 more). Patterns are class "
        "names ('Linear'), full module names or 're:<regex>' (re.match on full names). Linear-like modules: "
        "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj, "
        "model.layers.0.self_attn.o_proj and 11 more"
    )


def test_transformers_conv1d_is_not_linear_like():
    conv = transformers.pytorch_utils.Conv1D(8, 4)  # weight [in=4, out=8]
    model = nn.Sequential(conv, nn.Linear(8, 2))
    assert not is_linear_like(conv)
    # a target selecting it is refused (never skipped silently); ignored, the others are selected
    with pytest.raises(ValueError, match=r"^Sequential keeps 0 as transformers Conv1D \(a Linear whose weight is"):
        select_targets(model, ["re:.*"], [])
    assert list(select_targets(model, ["re:.*"], ["0"]).selected) == ["1"]


# --- case 10: ignore patterns that match nothing -------------------------------------------------------


def test_ignore_pattern_matching_nothing_warns_naming_it(caplog: pytest.LogCaptureFixture):
    model = llama(tied=False)
    # re.match anchors at the start: 're:head' does not match 'lm_head' (a typical mistake), and a typo
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.targets"):
        selected = resolve_targets(model, ["Linear"], ["re:head", "lm_haed"])
    assert "lm_head" in selected
    assert [r.getMessage() for r in caplog.records] == [
        f"ignore pattern {p!r} matches no module (check the spelling; 're:' patterns use re.match on full module "
        "names, e.g. 're:.*lm_head')"
        for p in ("re:head", "lm_haed")
    ]
    selection = select_targets(model, ["Linear"], ["re:head", "lm_haed", "re:.*lm_head"])
    assert selection.unmatched_ignore == ("re:head", "lm_haed")
    assert selection.ignored == {"lm_head": "re:.*lm_head"}


def test_default_ignore_on_a_model_without_lm_head_is_quiet(caplog: pytest.LogCaptureFixture):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.targets"):
        assert list(resolve_targets(model)) == ["0", "2"]
    assert caplog.records == []
    assert select_targets(model).unmatched_ignore == ("lm_head",)  # still reported to whoever asks


# --- case 11: tied weights -------------------------------------------------------------------------------


def test_targeting_a_head_tied_to_the_embedding_is_refused():
    model = llama(tied=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        select_targets(model, ["lm_head"], [])
    assert str(info.value) == (
        "lm_head shares its weight with model.embed_tokens (tied embeddings); compressing it changes "
        "model.embed_tokens too. Untie first (model.config.tie_word_embeddings=False and clone the weight) "
        "or add lm_head to ignore"
    )
    with pytest.raises(ValueError, match=r"^lm_head shares its weight with model\.embed_tokens"):
        select_targets(model, ["Linear"], [])  # every Linear, lm_head included
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # untied: allowed
    assert list(select_targets(llama(tied=False), ["lm_head"], []).selected) == ["lm_head"]


def test_a_module_tied_to_an_ignored_one_is_ignored_and_says_why():
    model = llama(tied=True)
    selection = select_targets(model, ["Linear"], ["model.embed_tokens"])
    assert selection.ignored == {"lm_head": "tied to model.embed_tokens"}
    assert "lm_head" not in selection.selected
    # two selected modules sharing one weight: compressed once, the second is reported as tied
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    selection = select_targets(nn.Sequential(a, b), ["Linear"], [])
    assert list(selection.selected) == ["0"]
    assert selection.ignored == {"1": "tied to 0"}


def test_everything_ignored_is_an_error():
    with pytest.raises(ValueError) as info:
        select_targets(llama(tied=False), ["re:.*q_proj$"], ["re:model"])
    assert str(info.value) == (
        "every module selected by targets ['re:.*q_proj$'] is excluded by ignore ['re:model'] (or tied to an "
        "ignored weight): model.layers.0.self_attn.q_proj, model.layers.1.self_attn.q_proj"
    )


# --- the matching rules themselves -----------------------------------------------------------------------


class MyLinear(nn.Linear):
    pass


@pytest.mark.parametrize(
    "pattern",
    [
        "Linear",
        "LlamaMLP",
        "Module",
        "lm_head",
        "model.layers.1",
        "re:model.layers.1",
        "re:.*mlp",
        "re:mlp",
        "re:.*proj$",
        "re:model\\.layers\\.0\\..*_proj",
        "re:.*(q|k)_proj",
        "re:",
        "re:.*lm_head",
        "LlamaRMSNorm",
    ],
)
def test_module_patterns_match_like_compressed_tensors(pattern: str):
    """Independent reference: compressed-tensors' own ``is_match`` (re.match on names, class names over the MRO)."""
    model = llama(layers=12)
    model.model.layers[3].mlp.up_proj = MyLinear(16, 32, bias=False)
    for name, module in model.named_modules():
        assert matches(name, module, pattern) == is_match(name, module, pattern), (name, pattern)


def test_prefix_anchoring_matches_later_layer_numbers_too():
    model = llama(layers=12)
    prefix = select_targets(model, ["re:model.layers.1"], [])
    assert sorted({n.split(".")[2] for n in prefix.selected}) == ["1", "10", "11"]
    anchored = select_targets(model, ["re:model.layers.1\\."], [])
    assert sorted({n.split(".")[2] for n in anchored.selected}) == ["1"]


def test_parameter_names_and_special_targets():
    model = llama(tied=False)
    # llm-compressor's ConstantPruning recipes name parameters
    selection = select_targets(model, ["re:.*q_proj.weight", "lm_head.weight"], [])
    assert list(selection.selected) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "lm_head"]
    for special in ("__ALL__", "__ALL_PRUNABLE__", "__ALL_QUANTIZABLE__"):
        assert list(select_targets(model, [special], ["lm_head"]).selected) == [*linears(0), *linears(1)]


def test_subclasses_match_their_base_class_name():
    model = nn.Sequential(MyLinear(4, 4), nn.Linear(4, 2))
    assert list(select_targets(model, ["Linear"], []).selected) == ["0", "1"]
    assert list(select_targets(model, ["MyLinear"], []).selected) == ["0"]


@pytest.mark.parametrize(
    ("targets", "ignore", "message"),
    [
        (
            ["re:(unclosed"],
            [],
            "invalid regex in target pattern 're:(unclosed': missing ), unterminated subpattern at position 0",
        ),
        (["Linear"], ["re:*"], "invalid regex in ignore pattern 're:*': nothing to repeat at position 0"),
        ([3], [], "target patterns must be strings (class name, full name or 're:<regex>'), got 3"),
        ([], [], "targets is empty: give at least one module pattern, e.g. ['Linear']"),
    ],
)
def test_bad_patterns(targets, ignore, message):
    with pytest.raises(ValueError) as info:
        select_targets(nn.Linear(2, 2), targets, ignore)
    assert str(info.value) == message


def test_selection_is_an_attrs_value_and_a_string_is_one_pattern():
    model = nn.Sequential(nn.Linear(2, 2))
    selection = select_targets(model, "Linear", "lm_head")
    assert isinstance(selection, TargetSelection)
    assert selection.targets == ("Linear",) and selection.ignore == ("lm_head",)
    assert selection.warnings() == [
        "ignore pattern 'lm_head' matches no module (check the spelling; 're:' patterns use re.match on full "
        "module names, e.g. 're:.*lm_head')"
    ]
    assert selection.warnings(quiet_ignore=["lm_head"]) == []


# --- names in messages ---------------------------------------------------------------------------------------


def test_compact_names_folds_layer_indices():
    names = [f"model.layers.{i}.mlp.up_proj" for i in range(30)] + ["lm_head"]
    names += [f"model.layers.{i}.self_attn.q_proj" for i in (0, 2, 5)] + ["model.layers.7.mlp.down_proj"]
    assert compact_names(names) == (
        "model.layers.{0..29}.mlp.up_proj, lm_head, model.layers.{0,2,5}.self_attn.q_proj, model.layers.7.mlp.down_proj"
    )
    assert compact_names(["0", "1", "2"]) == "{0..2}"  # nn.Sequential children
    assert compact_names([]) == ""
