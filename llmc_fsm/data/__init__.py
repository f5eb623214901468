"""Text sources, token windows and the perplexity protocol (standard library and torch only)."""

__all__: list[str] = []
