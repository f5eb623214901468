"""``llmc-fsm model-free MODEL --scheme PRESET --output DIR``: :func:`llmc_fsm.model_free_ptq` from the command line.

A data-free scheme applied to a safetensors checkpoint one shard at a time, without building the model
(docs/oneshot.md, "Model-free quantization"). Errors are one line (exit status 1); Ctrl-C / SIGTERM leave no output
(exit status 130 / 143).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import attrs
import torch

from llmc_fsm.cli.oneshot import interrupted, signals_as_interrupt
from llmc_fsm.models.hf_io import hub_model_unavailable, looks_like_hub_id
from llmc_fsm.models.known import KNOWN_MODELS, check_model_name
from llmc_fsm.oneshot_job.model_free import model_free_ptq
from llmc_fsm.oneshot_job.settings import OneshotSettings, _dtype_name

__all__ = ["add_cli"]

_HELP = "quantize a safetensors checkpoint shard by shard with a data-free scheme, without building the model"
_DESCRIPTION = (
    "llm-compressor's model_free_ptq: the Linear weights of the checkpoint in MODEL (a directory, a known model "
    "name or a Hugging Face Hub id) quantized with a data-free compressed-tensors scheme (FP8_BLOCK, FP8_DYNAMIC, "
    "W8A8, W4A16, NVFP4A16, MXFP4A16, ...), one shard at a time, and written to OUTPUT in compressed-tensors format; "
    "works for architectures transformers does not know and for checkpoints larger than memory. Schemes that need "
    "calibration data (static activation scales, a KV cache scheme) are refused: use `llmc-fsm oneshot`."
)


def add_cli(sub: Any) -> None:
    """Add the ``model-free`` subcommand to the ``llmc-fsm`` parser."""
    p = sub.add_parser("model-free", help=_HELP, description=_DESCRIPTION)
    p.add_argument("model", metavar="MODEL", help="checkpoint directory, known model name, or Hub id")
    p.add_argument("--scheme", required=True, help="compressed-tensors preset, e.g. FP8_BLOCK, W8A8, NVFP4A16")
    p.add_argument(
        "--group-size",
        type=int,  # a value below 1: refused in _run_cli
        default=None,
        metavar="N",
        help="replace the weight group size of an int group-wise --scheme (W4A16's 128: SmolLM2's width 576 needs 64)",
    )
    p.add_argument(
        "--ignore",
        nargs="*",
        metavar="NAME",
        help="module names or re: patterns left unquantized (default: lm_head; --ignore with no name: none); "
        "give MODEL before it",
    )
    p.add_argument("--output", required=True, metavar="DIR", help="output directory (created)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory holding a model")
    p.add_argument("--device", default=None, help="where the weights are rounded: cpu (default) or cuda:N")
    p.add_argument(
        "--dtype",
        type=_dtype_name,  # oneshot's spellings too (bf16, fp16, half, fp32, float)
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="read and write the float tensors in this dtype (also bf16, fp16, half, fp32, float; default: as "
        "stored; NVFP4 / MX need bfloat16)",
    )
    fmt = attrs.fields_dict(OneshotSettings)["quantization_format"]  # oneshot's flag: its help, checked as there
    p.add_argument("--quantization-format", default=None, help=fmt.metadata["help"], **fmt.metadata["cli"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for the run (default: torch's choice)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    # a value below 1: one line, exit status 1, as oneshot's (argparse's exit status 2 before; found by a tester)
    if args.group_size is not None and args.group_size < 1:
        msg = f"--group-size must be a positive int, got {args.group_size}"
        raise ValueError(msg)
    if args.threads is not None and args.threads < 1:
        msg = f"threads (--threads) must be a positive int, got {args.threads}"
        raise ValueError(msg)
    _check_model(args.model)
    logging.getLogger("llmc_fsm.oneshot_job.model_free").setLevel(logging.INFO)  # its closing summary line
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    wording = _CliIgnoreWording()
    modifiers = logging.getLogger(_MODIFIER_LOGGER)
    modifiers.addFilter(wording)
    try:
        with signals_as_interrupt():
            out = model_free_ptq(
                args.model,
                args.output,
                scheme=args.scheme,
                ignore=args.ignore,
                device=args.device,
                dtype=args.dtype,
                overwrite=args.overwrite,
                progress=args.progress,
                group_size=args.group_size,
                quantization_format=args.quantization_format,
            )
    except KeyboardInterrupt as exc:
        return interrupted("model-free", exc)
    finally:
        modifiers.removeFilter(wording)
    print(f"output: {out}")
    return 0


#: The logger of the quantization modifiers' line on a default ``ignore`` (:class:`_CliIgnoreWording`).
_MODIFIER_LOGGER = "llmc_fsm_quantization._base"


class _CliIgnoreWording(logging.Filter):
    """The modifier's line on the default ``ignore`` in this command's words: its "give ``ignore: []`` for that"
    (a recipe's spelling) becomes "give ``--ignore`` with no name for that", the flag that does it here (a tester ran
    ``llmc-fsm model-free --scheme W8A8`` and was told to give a recipe field the command does not take)."""

    RECIPE = "give ignore: [] for that"
    FLAG = "give --ignore with no name for that"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.RECIPE in message:
            record.msg, record.args = message.replace(self.RECIPE, self.FLAG), ()
        return True


def _check_model(model: str) -> None:
    """Refuse MODEL at once, as ``oneshot --model`` does, when it names nothing that can be read: not a known name,
    not an existing path and not shaped like a Hub ID (:func:`~llmc_fsm.models.known.check_model_name`), or a Hub ID
    that is not in the Hugging Face cache while the Hub cannot be reached
    (:func:`~llmc_fsm.models.hf_io.hub_model_unavailable`, 3 s at most; ``HF_HUB_OFFLINE``: not tried). A mistyped
    local directory took 37 s of Hub retries before its error (found by a tester).

    Raises:
        ValueError: an unknown name, a missing path, a file.
        RuntimeError: a Hub ID neither cached nor reachable.
    """
    check_model_name(model)
    if model not in KNOWN_MODELS and not Path(model).expanduser().exists() and looks_like_hub_id(model):
        missing = hub_model_unavailable(model)
        if missing is not None:
            raise RuntimeError(missing)
