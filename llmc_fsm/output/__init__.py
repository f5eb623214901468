"""The one-shot output: directory checks, saving in Hugging Face layout, the compressed format, the work directory."""

__all__: list[str] = []
