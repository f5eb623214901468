"""Models: the known real models, Hugging Face files, lazy (meta-device) loading, finding decoder layers."""

__all__: list[str] = []
