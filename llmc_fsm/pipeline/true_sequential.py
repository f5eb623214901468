"""One forward per decoder layer: each group of targets is compressed before any batch runs it.

The plain pipeline runs every decoder layer twice per batch: once with the
original weights while the modifiers' hooks gather statistics, and once with
the compressed weights to produce the next layer's inputs. Here the layer runs
once: every calibration batch runs as its own coroutine (a ``greenlet``), and each stops at
the input of each *group* of targets (modules called one after the other on
the same input tensor: ``q/k/v_proj``, ``o_proj``, ``gate/up_proj``,
``down_proj`` in a Llama layer) until every batch has delivered that input;
then the group is compressed (``session.sequential_epoch_end(group)``) and the
batches go on through the compressed modules. The outputs are the next
layer's inputs.

So a module's statistics come from the outputs of the *already compressed*
modules before it in the layer (``o_proj`` sees the attention of quantized
``q/k/v``), the order of the GPTQ reference code's ``--true-sequential``
option (Frantar et al., arXiv 2210.17323; IST-DASLab/gptq), and the
calibration costs one layer forward instead of ~1.75.

The batches are switched in batch order on the calling thread (greenlets are
not threads: nothing runs concurrently), so the hooks see the batches in the
same order as in the plain pipeline, and every computation runs on the
caller's thread. Threads were measured slower: torch's OpenMP teams of several
threads on 2 cores spin less and ran the GPTQ sweeps ~35% slower.

Which modules share an input is read from one recorded forward of the first
layer (:func:`llmc_fsm.pipeline.forward.record_calls`). A group's later members
get the head's input through their own pre-hooks (the modules are called with
a pre-hook that ends the call before the module computes anything), so their
statistics are complete when the group is compressed; when the forward then
really calls them, their modifiers ignore the call (CalibratedModifier skips
compressed targets).

Used only when every hooked module of the layer is a leaf hooked by pre-hooks
only, was called exactly once in the recorded forward, and no global module
hooks are installed (:func:`plan_groups`); otherwise the plain two-pass order runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from greenlet import greenlet
from torch import nn

from llmc_fsm.core.torch_hooks import global_forward_hooks_installed, hook_count
from llmc_fsm.pipeline.forward import Calls, Inputs, StopForward, layer_output

__all__ = ["plan_groups", "run_grouped"]


def plan_groups(layer: nn.Module, calls: Calls | None) -> list[list[nn.Module]] | None:
    """The groups of hooked modules of ``layer`` in call order, or ``None`` when the plain order must run.

    A group is a run of hooked modules called one after the other with the
    same input tensor (by ``calls``, a recorded forward of a layer of the same
    class). ``None`` when ``calls`` is ``None``, nothing in the layer is
    hooked, a hooked module has children or forward (post) hooks, the layer
    itself has forward hooks, a hooked module was not called exactly once in
    ``calls``, or global module hooks are installed.
    """
    if calls is None or global_forward_hooks_installed() or hook_count(layer, ("forward",)):
        return None
    hooked = {
        name: sub
        for name, sub in layer.named_modules()
        if sub is not layer and hook_count(sub, ("forward", "forward_pre"))
    }
    if not hooked:
        return None
    if any(hook_count(sub, ("forward",)) or next(sub.children(), None) is not None for sub in hooked.values()):
        return None
    sequence = [(name, source) for name, source in calls if name in hooked]
    if len(sequence) != len(hooked) or {name for name, _ in sequence} != set(hooked):
        return None
    groups: list[list[nn.Module]] = []
    last_source = None
    for name, source in sequence:
        if groups and source == last_source:
            groups[-1].append(hooked[name])
        else:
            groups.append([hooked[name]])
        last_source = source
    return groups


def run_grouped(
    layer: nn.Module,
    inputs: Inputs,
    groups: list[list[nn.Module]],
    compress: Callable[[list[nn.Module]], None],
) -> list[Any]:
    """Run every batch once through ``layer``, calling ``compress(group)`` when all batches reached a group.

    Args:
        layer: the decoder layer (its targets hooked by the modifiers).
        inputs: per batch, the layer's (args, kwargs).
        groups: from :func:`plan_groups`.
        compress: compresses a group (the pipeline passes ``session.sequential_epoch_end``). A group's head is
            paused inside its own call, which then goes on with the forward it began with (its input as it was, the
            weights the group now holds); the pipeline runs the layer with activation quantization off
            (:func:`llmc_fsm.pipeline.layer.activation_quantization_off`), so the compressed module computes that too.

    Returns:
        Per batch, the layer's output as the next layer needs it (:func:`~llmc_fsm.pipeline.forward.layer_output`;
        computed with every group compressed).

    Raises:
        Whatever a batch's forward or ``compress`` raised (the other batches' forwards are unwound first);
        RuntimeError: a batch reached the groups in another order than the first batch.
    """
    main = greenlet.getcurrent()
    siblings_calling = [False]
    handles = []

    def head_hook(index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            for sibling in groups[index][1:]:  # their pre-hooks see this input now; the call ends there
                siblings_calling[0] = True
                try:
                    sibling(*args, **kwargs)
                except StopForward:
                    pass
                finally:
                    siblings_calling[0] = False
            main.switch(index)  # back to the scheduler until every batch is here and the group is compressed

        return hook

    def stop_sibling(module: nn.Module, args: tuple[Any, ...]) -> None:
        if siblings_calling[0]:
            raise StopForward

    def batch(index: int) -> Any:
        args, kwargs = inputs[index]
        return layer_output(layer(*args, **kwargs), kwargs)  # what the next layer needs of it

    batches = [greenlet(functools.partial(batch, index)) for index in range(len(inputs))]
    try:
        for index, group in enumerate(groups):
            handles.append(group[0].register_forward_pre_hook(head_hook(index), with_kwargs=True))
            handles += [sibling.register_forward_pre_hook(stop_sibling) for sibling in group[1:]]
        for index, group in enumerate(groups):
            for number, let in enumerate(batches):
                reached = let.switch()  # runs batch `number` up to the input of the next group
                if not isinstance(reached, int) or reached != index:
                    _out_of_step(number, index, len(groups))
            compress(group)
        outputs = [let.switch() for let in batches]  # the rest of each forward, through compressed modules
        for number, out in enumerate(outputs):
            if isinstance(out, int) or not batches[number].dead:  # paused at a group again, not returned
                _out_of_step(number, len(groups), len(groups))
        return outputs
    finally:
        for let in batches:  # unwind forwards left halfway by an error
            if let and not let.dead:
                let.throw(greenlet.GreenletExit)
        for handle in handles:
            handle.remove()


def _out_of_step(number: int, group: int, count: int) -> None:
    where = f"at group {group + 1} of {count}" if group < count else "after the last group"
    msg = (
        f"calibration batch {number} did not reach the decoder layer's modules in the same order as the first "
        f"batch ({where}): the layer's forward depends on the data. Run the pipeline with true_sequential=False."
    )
    raise RuntimeError(msg)
