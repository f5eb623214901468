"""Finding a model's decoder layers: the blocks the sequential pipeline calibrates and compresses one at a time.

The layers are read from the model's own structure, never guessed by size: a Hugging Face model's decoder is
``model.get_decoder()`` (the language model of a vision-language or audio model, the decoder of an
encoder-decoder), and its layers are the ``nn.ModuleList`` it holds as ``layers`` (or ``h``, ``blocks``,
``layer``), whose length is the text config's ``num_hidden_layers`` where the config says so. The blocks need not
share a class: hybrid stacks (Jamba's mamba and attention layers, Falcon-H1, Nemotron-H) run layer by layer.
"""

from __future__ import annotations

from torch import nn

from llmc_fsm.toolkit.targets import model_family

__all__ = [
    "UnsupportedArchitectureError",
    "check_calibrates_from_text",
    "check_rwkv_rescaling",
    "find_decoder_layers",
]

#: Attribute names under which a decoder keeps its layer list, most common first.
LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer", "decoder_layers")


class UnsupportedArchitectureError(ValueError):
    """A model whose decoder layers cannot be found from its structure (raised before any work)."""


def _num_layers(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for key in ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers"):
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _structural(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The layers of ``model.get_decoder()`` (a Hugging Face model), or ``None`` when it has no ``get_decoder``."""
    get_decoder = getattr(model, "get_decoder", None)
    if not callable(get_decoder):
        return None
    try:
        decoder = get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    if not isinstance(decoder, nn.Module):
        return None
    prefix = next((name for name, module in model.named_modules() if module is decoder), None)
    if prefix is None:
        return None
    expected = _num_layers(model)
    candidates = []
    for attr in LAYER_LIST_NAMES:
        child = getattr(decoder, attr, None)
        if isinstance(child, nn.ModuleList) and len(child) > 0:
            candidates.append((attr, child))
    if not candidates:  # e.g. a decoder that keeps its blocks one level down (``decoder.block.layers``)
        candidates = [
            (name, module)
            for name, module in decoder.named_modules()
            if isinstance(module, nn.ModuleList) and len(module) > 0 and module is not decoder
        ]
    if expected is not None:
        matching = [c for c in candidates if len(c[1]) == expected]
        candidates = matching or candidates
    if not candidates:
        return None
    attr, layers = candidates[0]
    return (f"{prefix}.{attr}" if prefix else attr), layers


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Return ``(qualified name, ModuleList)`` of the model's decoder layers.

    A Hugging Face model (one with ``get_decoder``): the ``ModuleList`` its
    decoder (``model.get_decoder()``: the language model of a multimodal
    model, the decoder of an encoder-decoder) holds as ``layers`` / ``h`` /
    ``blocks`` / ``layer`` (``model.model.layers`` for Llama,
    ``model.model.language_model.layers`` for Qwen2-VL, ``transformer.h`` for
    GPT-2), preferring the one whose length is the text config's
    ``num_hidden_layers``. Its blocks may have different classes (hybrid
    stacks). Any other module (a plain ``nn.Module``): the largest
    ``nn.ModuleList`` whose children all have the same class, ties to the one
    found first.

    Raises:
        UnsupportedArchitectureError: (a ``ValueError``) no decoder layer list
            is found; the message names the family.
    """
    found = _structural(model)
    if found is not None:
        return found
    if callable(getattr(model, "get_decoder", None)):
        msg = (
            f"cannot find the decoder layers of {model_family(model)}: its decoder (get_decoder()) holds no "
            f"nn.ModuleList named {', '.join(LAYER_LIST_NAMES)}; the sequential pipeline needs one"
        )
        raise UnsupportedArchitectureError(msg)
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and (best is None or len(module) > len(best[1])):
                best = (name, module)
    if best is None:
        msg = (
            f"cannot find the decoder layers of {type(model).__name__}: the sequential pipeline needs an "
            "nn.ModuleList of same-class blocks (e.g. model.model.layers)"
        )
        raise UnsupportedArchitectureError(msg)
    return best


def check_calibrates_from_text(model: nn.Module, *, evaluates: bool = False) -> None:
    """Refuse, before any work, a model whose decoder layers token ids alone cannot run.

    An encoder-decoder model (``config.is_encoder_decoder``: Whisper, T5, BART...) runs its decoder layers on the
    encoder's output, and the sequential pipeline's calibration data (and the perplexity evaluation's windows,
    ``evaluates=True``) are token ids given as ``input_ids`` to the model's forward: Whisper's encoder reads audio
    features, not text, and its forward takes no ``input_ids``. Decoder-only models, and multimodal models whose
    language model runs on text alone (LLaVA, Qwen2-VL, Qwen2-Audio...), pass. A one-shot job that neither
    calibrates nor evaluates (round-to-nearest of the weights, activations dynamic or not quantized: e.g.
    llm-compressor's Whisper ``FP8_DYNAMIC`` example) does not call this: it runs on every Linear of encoder and
    decoder.

    It also refuses an RWKV model whose config rescales (``rescale_every`` > 0 and more layers than that: the
    RWKV-4 checkpoints): its forward halves the hidden states between blocks, outside the blocks the
    pipeline runs one by one, and its first inference forward divides blocks' output weights by powers of 2 in place
    (:func:`check_rwkv_rescaling`).

    Raises:
        UnsupportedArchitectureError: (a ``ValueError``) an encoder-decoder model; one line naming the family,
            its decoder layers, why, and what does run. Or as :func:`check_rwkv_rescaling`.
    """
    check_rwkv_rescaling(model)
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False):
        return
    try:
        where = f" ({find_decoder_layers(model)[0]})"
    except UnsupportedArchitectureError:
        where = ""
    if evaluates:
        what = "which perplexity evaluation (token ids as the model's input_ids, --eval-text / eval_text) does not give"
        remedy = "leave out the evaluation text"
    else:
        what = "which the sequential pipeline's calibration (token ids as the model's input_ids) does not produce"
        remedy = "a recipe that needs no calibration data (e.g. FP8_DYNAMIC or W8A8 round-to-nearest) runs on it"
    msg = (
        f"{model_family(model)} is an encoder-decoder model: its decoder layers{where} attend to the encoder's output, "
        f"{what}; it calibrates and evaluates decoder-only language models (multimodal ones on text, through their "
        f"language model): not supported; {remedy}"
    )
    raise UnsupportedArchitectureError(msg)


def check_rwkv_rescaling(model: nn.Module) -> None:
    """Refuse, before any work, an RWKV model (``config.model_type == 'rwkv'``) whose config rescales its blocks.

    ``RwkvModel.forward`` in inference (eval mode) with ``config.rescale_every = r > 0`` halves the hidden states
    after every ``r``-th block, between the blocks, and at its first call divides block ``i``'s
    ``attention.output`` and ``feed_forward.value`` weights by ``2 ** (i // r)`` in place (float16 overflow guard).
    The sequential pipeline gives each block the previous block's output as it is (no halving), and would calibrate
    and save the divided weights, which the loaded checkpoint divides again. With ``num_hidden_layers <= r`` no
    block's input is halved and no weight changes (every factor is 1): such a model passes.

    Raises:
        UnsupportedArchitectureError: (a ``ValueError``) one line naming the family, ``rescale_every``, why, and
            the remedy (``rescale_every: 0`` in the model's ``config.json``: outside float16 the model then computes the
            same up to LayerNorm's epsilon, which alone sees the scale).
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "rwkv":
        return
    every, layers = getattr(config, "rescale_every", 0), _num_layers(model)
    if not isinstance(every, int) or every <= 0 or layers is None or layers <= every:
        return
    msg = (
        f"{model_family(model)} rescales its blocks in inference (rescale_every={every} in its config, "
        f"{layers} layers): its forward halves the hidden states every {every} blocks and divides the later "
        "blocks' output weights by powers of 2 in place, which the sequential pipeline (each block given the previous "
        "block's output) would miss and then save: not supported; set rescale_every to 0 in the model's config.json "
        "(outside float16 the model then computes the same up to LayerNorm's epsilon)"
    )
    raise UnsupportedArchitectureError(msg)
