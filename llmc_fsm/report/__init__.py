"""The one-shot report (measured per layer) and its plots."""

__all__: list[str] = []
