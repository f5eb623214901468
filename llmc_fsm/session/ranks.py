"""What ``Session.initialize`` does under ``torch.distributed``: ranks agree before any work; wrappers unwrapped.

* :func:`check_ranks_agree` — every rank compares a digest of its recipe and of
  its model's parameter names/shapes, and the expected world size when one was
  given (state key ``world_size``); any disagreement raises the same
  ``ValueError`` on every rank before a modifier is initialized;
* :func:`unwrap_model` / :func:`unwrap_state` — a ``DistributedDataParallel`` /
  ``DataParallel`` model, one compiled by ``torch.compile`` (an ``OptimizedModule``) or a
  peft ``PeftModel`` is replaced by the module inside it, whose parameters are the live ones the
  wrapper trains (so module names carry no ``module.`` / ``_orig_mod.`` / ``base_model.model.`` prefix).

See :mod:`llmc_fsm.toolkit.distributed` for the collectives and ``docs/distributed.md``.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import torch
from torch import nn

from llmc_fsm.core.state import State
from llmc_fsm.toolkit.distributed import _digest, all_gather_ints, get_world_size, is_distributed

__all__ = ["check_ranks_agree", "inference_tensors_refusal", "unwrap_model", "unwrap_state"]


def _recipe_digest(fingerprint: list[dict]) -> int:
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return _digest(re.sub(r" at 0x[0-9a-fA-F]+", "", text).encode())  # object reprs carry addresses


def _model_digest(model: Any) -> int:
    if not isinstance(model, nn.Module):
        return 0
    shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    return _digest(repr(shapes).encode())


def _positive_int_or_none(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{name} must be a positive int (the number of ranks expected), got {value!r}"
        raise ValueError(msg)
    return value


def _ranks(table: list[list[int]], column: int) -> str:
    groups: dict[int, list[int]] = {}
    for rank, row in enumerate(table):
        groups.setdefault(row[column], []).append(rank)
    return "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v & 0xFFFFFFFF:08x}" for v, r in groups.items()
    )


def check_ranks_agree(fingerprint: list[dict], state: State) -> None:
    """Raise the same error on every rank unless all ranks agree on recipe, model structure and world size.

    Called by ``Session.initialize`` before any modifier is initialized. One
    ``all_gather`` of three int64 per rank: a digest of the recipe's ``fingerprint`` (each
    modifier's label, class, stage and arguments:
    :func:`llmc_fsm.recipes.fingerprint.recipe_fingerprint`), a digest of the model's
    parameter names, shapes and dtypes, and the expected world size (state key
    ``world_size``, optional). With ``world_size`` given and no process group,
    it must be 1.

    Raises:
        ValueError: ``world_size`` is not a positive int; the ranks disagree (on
            every rank, with the same message); the world size differs from
            the expected one.
        DistributedError: the collective failed.
    """
    expected = _positive_int_or_none("state world_size", state.get("world_size"))
    world = get_world_size()
    if not is_distributed():
        if expected is not None and expected != world:
            msg = (
                f"expected world size {expected} (state world_size) but this process runs without a torch.distributed "
                f"process group of that size (world size {world}): launch it with torchrun --nproc-per-node ..."
            )
            raise ValueError(msg)
        return
    row = [_recipe_digest(fingerprint), _model_digest(state.get("model")), -1 if expected is None else expected]
    table = all_gather_ints(row, what="all_gather (recipe check at initialize)")
    problems = []
    if len({r[0] for r in table}) > 1:
        problems.append(f"the recipe differs between ranks (digest per rank — {_ranks(table, 0)})")
    if len({r[1] for r in table}) > 1:
        problems.append(f"the model's parameter names/shapes differ between ranks ({_ranks(table, 1)})")
    wanted = sorted({r[2] for r in table if r[2] != -1})
    if len(wanted) > 1 or (wanted and len({r[2] for r in table}) > 1):
        given = ", ".join(f"rank {k}: {r[2] if r[2] != -1 else 'none'}" for k, r in enumerate(table))
        problems.append(f"the ranks expect different world sizes ({given})")
    elif wanted and wanted[0] != world:
        problems.append(f"expected world size {wanted[0]} (state world_size) but the process group has {world} ranks")
    if problems:
        msg = (
            f"initialize() refused on every rank of the process group ({world} ranks): " + "; ".join(problems) + ". "
            "Every rank must run the same recipe on the same model; launch them with the same arguments. "
            "No modifier was initialized."
        )
        raise ValueError(msg)


# --------------------------------------------------------------------------- wrappers
def unwrap_model(model: Any) -> Any:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` / ``torch.compile`` / peft ``PeftModel``
    wrappers, in any nesting (``model`` itself otherwise).

    The wrapped module's parameters are the ones the wrapper trains, so
    modifiers that change them in place act on the live model, under the
    model's own module names (``lm_head``, not ``_orig_mod.lm_head`` or ``base_model.model.lm_head``; a peft model's
    base model still holds its adapter layers, which targets never select: :func:`llmc_fsm.toolkit.select_targets`).

    Raises:
        ValueError: a ``FullyShardedDataParallel`` model (its parameters are sharded across ranks; not
            supported).
    """
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
            continue
        if _is_compiled(model):
            model = model._orig_mod
            continue
        if _is_peft(model):
            model = model.get_base_model()
            continue
        if type(model).__name__ == "FullyShardedDataParallel":
            msg = (
                "FullyShardedDataParallel shards the parameters across ranks, so a modifier cannot see whole "
                "weights; wrap the model in DistributedDataParallel instead"
            )
            raise ValueError(msg)
        return model


def _is_peft(model: Any) -> bool:
    """Whether ``model`` is peft's ``PeftModel`` (duck-typed: its ``peft_config`` and ``get_base_model``; peft is not
    imported here)."""
    return "peft" in sys.modules and hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def _is_compiled(model: Any) -> bool:
    """Whether ``model`` is ``torch.compile``'s ``OptimizedModule`` (torch._dynamo is imported once anything is
    compiled, so it is not imported here for a model that is not)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def inference_tensors_refusal(model: Any, what: str = "model") -> str | None:
    """One line when ``model`` holds parameters made under ``torch.inference_mode()`` (they keep no version counter,
    which the session's guard reads, and cannot be changed in place outside that mode: it failed with a bare
    RuntimeError, found by a tester), else ``None``."""
    if isinstance(model, nn.Module) and any(p.is_inference() for p in model.parameters()):
        return (
            f"the {what}'s parameters were made under torch.inference_mode(), which keeps them from being changed or "
            f"watched outside it: load (or build) the {what} outside inference_mode"
        )
    return None


def unwrap_state(state: State) -> State:
    """``state`` with ``model`` and ``teacher`` unwrapped (:func:`unwrap_model`); ``state`` if none is wrapped.

    Raises:
        ValueError: as :func:`unwrap_model`; a ``model`` whose parameters are ``DTensor`` s (FSDP2's ``fully_shard``,
            tensor parallelism: sharded across ranks; a teacher, only run forward, is taken) or that is an
            ``AveragedModel`` (an EMA / SWA copy, whose weights are averaged from the trained model's: the session
            pruned the copy while the trained model stayed dense, found by a tester; as a ``teacher`` it is taken).
    """
    updates = {}
    for key in ("model", "teacher"):
        value = state.get(key)
        inner = unwrap_model(value) if value is not None else None
        if (
            key == "model"
            and isinstance(inner, nn.Module)
            and any(type(p).__name__ == "DTensor" for p in inner.parameters())
        ):
            msg = (
                "the model's parameters are DTensors (FSDP2's fully_shard or tensor parallelism): they are sharded "
                "across ranks, so a modifier cannot see whole weights; wrap the model in DistributedDataParallel "
                "instead"
            )
            raise ValueError(msg)
        if (refusal := inference_tensors_refusal(inner, key)) is not None:  # a teacher too: the guard reads it
            raise ValueError(refusal)
        if key == "model" and isinstance(inner, torch.optim.swa_utils.AveragedModel):
            msg = (
                "the model is an AveragedModel (an EMA / SWA copy): its weights are averaged from the trained "
                "model's, not trained, so the modifiers would change the copy and not the model the optimizer "
                "trains; give the session that model (to compress the averaged weights themselves, give the "
                "copy's .module)"
            )
            raise ValueError(msg)
        if inner is not value:
            updates[key] = inner
    return state.merged(updates) if updates else state
