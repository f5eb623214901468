"""Recipes: the data model, reading YAML/JSON, building stages and modifiers, llm-compressor's dialect, history.

Imports :mod:`llmc_fsm.core` only.
"""

__all__: list[str] = []
