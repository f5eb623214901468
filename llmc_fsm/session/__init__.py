"""The compression session: lifecycle calls, events, scheduling, checkpoints, ranks and ``explain``."""

__all__: list[str] = []
