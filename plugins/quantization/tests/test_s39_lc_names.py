"""Importing an llm-compressor modifier name a plugin package lacks explains itself in one line."""

from __future__ import annotations

import importlib

import llmc_fsm_quantization
import pytest

QUIP = (
    "QuIPModifier is an llm-compressor modifier that llmc-fsm does not implement (QuIP-style Hadamard rotations of "
    "every Linear's input at run time, which transformers does not apply when it loads a compressed-tensors "
    "checkpoint; SpinQuantModifier fuses R1/R2 rotations into the weights instead); remove it from the recipe or use "
    "llm-compressor for it."
)


def test_importing_quip_from_the_quantization_package_says_it_is_not_implemented():
    """Found by a tester: an llm-compressor script translated by swapping imports stopped with a bare "cannot import
    name 'QuIPModifier' from 'llmc_fsm_quantization'"; it now carries the sentence a recipe naming it gets."""
    with pytest.raises(ImportError) as info:
        from llmc_fsm_quantization import QuIPModifier  # noqa: F401
    assert str(info.value) == QUIP


def test_attribute_access_to_a_lacking_name_is_an_attribute_error_with_the_same_line():
    """hasattr / getattr with a default keep working: the name is an AttributeError there, not an ImportError."""
    assert not hasattr(llmc_fsm_quantization, "QuIPModifier")
    assert getattr(llmc_fsm_quantization, "QuIPModifier", None) is None
    with pytest.raises(AttributeError) as info:
        llmc_fsm_quantization.QuIPModifier  # noqa: B018
    assert str(info.value) == QUIP
    with pytest.raises(AttributeError) as info:
        llmc_fsm_quantization.NoSuchThing  # noqa: B018
    assert str(info.value) == "module 'llmc_fsm_quantization' has no attribute 'NoSuchThing'"


def _sparsegpt_from_quantization():
    from llmc_fsm_quantization import SparseGPTModifier  # noqa: F401


def _gptq_from_pruning():
    from llmc_fsm_pruning import GPTQModifier  # noqa: F401


def _quip_from_training():
    from llmc_fsm_training import QuIPModifier  # noqa: F401


@pytest.mark.parametrize(("package", "name", "statement", "message"), [
    ("llmc_fsm_quantization", "SparseGPTModifier", _sparsegpt_from_quantization,
     "SparseGPTModifier is in llmc-fsm-pruning, not llmc_fsm_quantization: from llmc_fsm_pruning import "
     "SparseGPTModifier"),
    ("llmc_fsm_pruning", "GPTQModifier", _gptq_from_pruning, "GPTQModifier is in llmc-fsm-quantization, not "
     "llmc_fsm_pruning: from llmc_fsm_quantization import GPTQModifier"),
    ("llmc_fsm_training", "QuIPModifier", _quip_from_training, QUIP),
])  # fmt: skip
def test_each_plugin_package_names_where_a_modifier_it_lacks_is(package, name, statement, message):
    """The pruning and training packages explain the same way (a modifier of another plugin: where it is); each
    case is a real ``from ... import ...`` statement."""
    module = importlib.import_module(package)
    with pytest.raises(ImportError) as info:
        statement()
    assert str(info.value) == message
    assert not hasattr(module, name)


def test_importing_llmcompressors_autoround_mask_fix_says_to_leave_it_out():
    """llm-compressor's AutoRound custom-dataset example imports fix_batch_if_needed beside AutoRoundModifier; the
    swapped import failed bare. It now says what the function did there and to drop the line."""
    with pytest.raises(ImportError) as info:
        from llmc_fsm_quantization import fix_batch_if_needed  # noqa: F401
    assert str(info.value) == (
        "fix_batch_if_needed is llm-compressor's AutoRound mask fix (it zeroes the last attention_mask position of an "
        "unpadded row); llmc-fsm needs none: leave out the dataset.map(fix_batch_if_needed) line (docs/oneshot.md, "
        '"Datasets from llm-compressor scripts")'
    )
