"""The sequential calibration pipeline: one decoder layer at a time, in memory or streamed from disk."""

__all__: list[str] = []
