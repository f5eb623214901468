"""The lifecycle's vocabulary: errors, the transition table, state, the modifier base class, hook specs, the registry.

Lowest layer: imports nothing else of llmc_fsm. Public names are re-exported by :mod:`llmc_fsm`.
"""

__all__: list[str] = []
