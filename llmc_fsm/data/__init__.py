"""Text sources, token windows and the perplexity protocol (``protocol``, ``text_files``: standard library and torch
only); image-caption calibration data (``images``: transformers' processors and PIL)."""

__all__: list[str] = []
