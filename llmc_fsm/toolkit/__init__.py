"""Public toolkit for modifier authors: the calibrated-modifier base, the OBS sweep, targets, layer error, ranks.

Imports only :mod:`llmc_fsm.core`. See ``docs/plugins.md``, "Writing a calibrated modifier".
"""

__all__: list[str] = []
