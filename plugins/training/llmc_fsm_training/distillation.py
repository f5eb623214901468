"""OutputDistillationModifier: knowledge distillation on the output logits.

Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural Network"
(arXiv:1503.02531), section 2: the student is trained on a weighted sum of its own
loss and the cross-entropy against the teacher's temperature-softened outputs; the
soft term is multiplied by ``T**2`` so its gradient magnitude does not depend on
the temperature. We use the KL divergence (cross-entropy minus the teacher's
entropy, a constant for the student: same gradients, 0 when student == teacher)::

    loss = (1 - alpha) * student_loss + alpha * T**2 * KD
    KD   = mean over positions p of  sum_v  q_t(v) * (log q_t(v) - log q_s(v))
    q_t  = softmax(teacher_logits / T),  q_s = softmax(student_logits / T)

"Positions" are every (sequence, token) of the logits; when the student was called
with an ``attention_mask`` (1 = real token), by keyword or positionally (found by
binding the call's arguments to the student's ``forward`` signature), the mean is
taken over real tokens only; a mask whose shape is not the logits' leading shape (a
4-D attention mask) is refused at ``loss_calculated`` (:func:`distillation_kl`).

How the modifier gets the logits and the teacher's input
--------------------------------------------------------
At initialize it registers a forward hook on the student (``state.model``) through
:meth:`Modifier.register_hook` (removed at finalize). From each ``batch_start`` while
the modifier is active to the batch's ``loss_calculated``, the hook keeps the
student's latest output logits *and the inputs of that call* (nothing is held
between batches, before ``start`` or after ``end``). At ``loss_calculated`` the
teacher is run under ``torch.no_grad()`` on those same inputs (minus ``labels`` and
loss-only keyword arguments), so the integration needs to pass nothing but the
loss: any loop that calls ``model(...)`` and then ``session.loss_calculated(loss)``
works, whatever the batch format. The captured tensors are released right after.
A ``loss_calculated`` with no student training forward since ``batch_start``
leaves the loss unchanged and emits a ``RuntimeWarning``.

Devices
-------
The teacher runs where its weights are: the student's inputs are moved to the
teacher's device for its forward (nothing is copied when both are on the same
device) and the teacher's logits to the student's, where the loss is computed.
The modifier moves no model itself; the integrations place the teacher
(:func:`llmc_fsm.integrations.place_teacher`: by default on the student's
device, or where ``teacher_device`` says). Tensors the modifier holds (the
last loss terms, also when loaded from a checkpoint) live on the student's device.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.nn.functional as F

from llmc_fsm import Modifier
from llmc_fsm.toolkit import compact_names

if TYPE_CHECKING:
    from llmc_fsm import Event, State

__all__ = ["OutputDistillationModifier", "distillation_kl", "logits_of", "model_device", "to_device", "vocabulary_size"]

logger = logging.getLogger(__name__)

#: Keyword arguments of the student's call that are not model inputs for the teacher.
_NOT_INPUTS = frozenset({"labels", "num_items_in_batch", "return_loss"})


@attrs.define(eq=False)
class _TeacherUse:
    """The initialized distillation modifiers using one teacher, and the training mode each of the teacher's modules
    had before the first of them put it in eval mode (both held weakly: nothing here keeps a teacher alive)."""

    modes: weakref.WeakKeyDictionary[torch.nn.Module, bool]
    users: weakref.WeakSet[OutputDistillationModifier] = attrs.field(factory=weakref.WeakSet)


#: teacher -> its :class:`_TeacherUse`, while a modifier of a live session uses it. A teacher shared by two sessions
#: is put back in the mode it was given in only when the last of them finalizes: the first finalize put it back in
#: train mode while the other still used it (its distillation term ran the teacher's dropout), and the last one
#: "restored" the eval mode it had seen (found by a tester).
_TEACHERS: weakref.WeakKeyDictionary[torch.nn.Module, _TeacherUse] = weakref.WeakKeyDictionary()
_TEACHERS_LOCK = threading.Lock()


def _hold_teacher(teacher: torch.nn.Module, user: OutputDistillationModifier) -> None:
    """Put ``teacher`` in eval mode for ``user``; the modes it had are recorded by its first user."""
    with _TEACHERS_LOCK:
        use = _TEACHERS.get(teacher)
        if use is None:
            modes = weakref.WeakKeyDictionary((m, m.training) for m in teacher.modules())
            use = _TEACHERS[teacher] = _TeacherUse(modes)
        use.users.add(user)
        teacher.eval()


def _release_teacher(teacher: torch.nn.Module, user: OutputDistillationModifier) -> None:
    """``user`` no longer uses ``teacher``; the last user gives each of its modules back its recorded mode."""
    with _TEACHERS_LOCK:
        use = _TEACHERS.get(teacher)
        if use is None:
            return
        use.users.discard(user)
        if not use.users:
            for module, training in use.modes.items():
                module.training = training
            del _TEACHERS[teacher]


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model output: ``output.logits``, ``output["logits"]``, the tensor itself, or in a tuple (a
    transformers model called with ``return_dict=False``) ``output[0]``, or ``output[1]`` when ``output[0]`` is a
    0-dim tensor (the loss of a call with ``labels``: it was taken for the logits and refused, found by a tester).

    Raises:
        TypeError: the output holds no logits tensor (the message advises calling the model with
            ``return_dict=True``).
    """
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None and isinstance(output, tuple | list) and output:
        first = output[0]
        if isinstance(first, torch.Tensor) and first.dim() == 0 and len(output) > 1:  # (loss, logits, ...)
            first = output[1]
        logits = first if isinstance(first, torch.Tensor) and first.dim() > 0 else None
    if not isinstance(logits, torch.Tensor):
        msg = (
            f"cannot find logits in a model output of type {type(output).__name__}: distillation reads "
            "output.logits, output['logits'], or of a tuple the first element (the second after a 0-dim loss); "
            "call the model with return_dict=True"
        )
        raise TypeError(msg)
    return logits


def model_device(model: Any) -> torch.device | None:
    """The device of ``model``'s first parameter (or buffer); ``None`` for a model without tensors."""
    for tensor in (*model.parameters(), *model.buffers()) if isinstance(model, torch.nn.Module) else ():
        return tensor.device
    return None


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (nested in tuples, lists and dicts) on ``device``; the rest as it is.

    A tensor already on ``device`` is returned itself (no copy).
    """
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [to_device(item, device) for item in value]
    if isinstance(value, tuple):
        items = [to_device(item, device) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # a namedtuple keeps its type
    return value


def distillation_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``T**2 * mean_p KL(softmax(t/T) || softmax(s/T))`` over positions (real tokens with a mask).

    The soft-target term of Hinton, Vinyals & Dean 2015, "Distilling the Knowledge in a Neural Network"
    (arXiv:1503.02531), section 2: both distributions softened by the temperature ``T``, the term scaled by ``T**2``
    so that its gradients keep their magnitude whatever ``T``.

    Args:
        student_logits: ``[..., vocab]``, any float dtype.
        teacher_logits: the same shape (moved to the student's device).
        temperature: ``T``, a finite number > 0.
        attention_mask: ``None`` (every position counts), or the logits' leading shape ``[...]`` (1/True = real
            token; the mean is then over real tokens).

    Returns:
        A 0-dim float32 tensor on the student's device (0 when the two distributions agree).

    Raises:
        ValueError: the two logits have different shapes; ``temperature`` is not a finite number > 0 (0 gave NaN, a
            negative one a number); ``attention_mask``'s shape is not the logits' leading shape (it was ignored and
            the mean taken over padding too). Found by a tester.
    """
    if student_logits.shape != teacher_logits.shape:
        msg = (
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "differ: distillation needs the same vocabulary and inputs"
        )
        raise ValueError(msg)
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        t = math.nan
    if isinstance(temperature, bool) or not math.inf > t > 0:
        msg = f"temperature must be a finite number > 0, got {temperature!r}"
        raise ValueError(msg)
    positions = tuple(student_logits.shape[:-1])
    if attention_mask is not None and tuple(attention_mask.shape) != positions:
        msg = (
            f"attention_mask has shape {tuple(attention_mask.shape)}, the logits {tuple(student_logits.shape)}: "
            f"the mask needs the logits' leading shape {positions}, one entry per position (1 = real token); pass "
            "such a mask, or None to average over every position"
        )
        raise ValueError(msg)
    log_q_s = F.log_softmax(student_logits.float() / t, dim=-1)
    log_q_t = F.log_softmax(teacher_logits.to(log_q_s.device).float() / t, dim=-1)
    kl = (log_q_t.exp() * (log_q_t - log_q_s)).sum(dim=-1)  # [...] per position
    if attention_mask is not None:
        weight = attention_mask.to(device=kl.device, dtype=kl.dtype)
        kd = (kl * weight).sum() / weight.sum().clamp_min(1.0)
    else:
        kd = kl.mean()
    return kd * (t * t)


def _float_not_bool(value: Any) -> Any:
    """``float(value)``, a boolean left as it is for the validator to refuse (``alpha: true`` was read as 1.0 while
    other float fields refuse booleans: found by a tester)."""
    return value if isinstance(value, bool) else float(value)


def _temperature(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.inf > float(value) > 0:
        msg = f"temperature must be a finite number > 0, got {value!r}"
        raise ValueError(msg)


def _alpha(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        msg = f"alpha must be a number in [0, 1], got {value!r}"
        raise ValueError(msg)


def _shared_with_student(student: torch.nn.Module, teacher: torch.nn.Module) -> list[str]:
    """The student's names of what the teacher shares with it and must not: a parameter the student trains
    (``requires_grad``; the same object or the same storage, as ``load_state_dict(..., assign=True)`` makes: the
    teacher's logits would follow it, the distillation loss tending to 0, as with a peft model's base model), or a
    module whose forward depends on its training mode (dropout with ``p > 0``, an attention or RNN module with a
    ``*dropout`` rate above 0, batch norm, also by its running statistics' storage: the teacher's eval mode would
    switch the student's, or the teacher would read the student's statistics). A frozen shared embedding, kept once
    to save memory, is neither. Found by testers."""
    teacher_params = {id(p) for p in teacher.parameters()}
    teacher_modules = {id(m) for m in teacher.modules()}
    teacher_storage = {_storage(t) for t in (*teacher.parameters(), *teacher.buffers())} - {None}
    names = [
        n.rpartition(".")[0] or n
        for n, p in student.named_parameters()
        if p.requires_grad and (id(p) in teacher_params or _storage(p) in teacher_storage)
    ]
    for n, m in student.named_modules():
        if not _training_mode_matters(m):
            continue
        buffers = [_storage(b) for b in m.buffers(recurse=False)]
        if id(m) in teacher_modules or any(b is not None and b in teacher_storage for b in buffers):
            names.append(n)
    return list(dict.fromkeys(names))


def vocabulary_size(model: Any) -> int | None:
    """The width of ``model``'s logits: its output embeddings' rows (``get_output_embeddings()``: ``out_features``
    of a ``Linear``, else the weight's first dimension), else ``config.vocab_size``; ``None`` when neither is there
    (a model that is not a transformers model)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, torch.nn.Linear):
        return head.out_features
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _no_logits_reason(model: Any, role: str) -> str | None:
    """Why ``model`` (the ``role``: "student" or "teacher") cannot take part in output distillation, or ``None``.

    Two transformers models are seen (duck-typed, transformers is not imported): an encoder-decoder model
    (``config.is_encoder_decoder``: run on the student's inputs without ``labels`` it has no decoder input, and its
    logits follow the decoder's positions, not the inputs'), and a base model without a head (``model.base_model is
    model`` and no output embeddings, as ``AutoModel`` loads: its output has hidden states, no logits). Both were
    refused only at the first ``loss_calculated`` (found by a tester). Other models are not judged here.
    """
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
        return (
            f"the {role} is a {name}, an encoder-decoder model (config.is_encoder_decoder): distillation runs the "
            "teacher on the student's inputs (without labels, so no decoder input) and compares the two models' "
            "logits position by position, which needs decoder-only language models; pass a decoder-only causal LM "
            "(AutoModelForCausalLM) instead"
        )
    get = getattr(model, "get_output_embeddings", None)
    if isinstance(getattr(model, "base_model_prefix", None), str) and callable(get):
        if getattr(model, "base_model", None) is model and get() is None:
            return (
                f"the {role} is a {name}, a transformers base model without a language-modeling head: its output "
                "has hidden states, no logits, and distillation compares the two models' logits; pass the model "
                "with its head (AutoModelForCausalLM.from_pretrained instead of AutoModel.from_pretrained)"
            )
    return None


def _storage(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s data lies (a ``DTensor``: its local shard's; ``None`` on ``meta``, when empty or unknown:
    nothing shared)."""
    if tensor.is_meta or tensor.numel() == 0:
        return None
    local = tensor.to_local() if callable(getattr(tensor, "to_local", None)) else tensor
    try:
        return local.untyped_storage().data_ptr()
    except RuntimeError:  # a storage torch does not expose (found with FSDP2's DTensor before to_local)
        return None


def _training_mode_matters(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own forward depends on its training mode: a norm keeping running statistics (batch,
    instance), dropout with ``p > 0``, ``RReLU``, or among its attributes a rate (not an int) above 0 named ``*drop*``,
    ``*jitter*`` or ``*noise*`` (transformers' attention modules apply ``attention_dropout`` when ``self.training``,
    mixture-of-experts routers their ``router_jitter_noise``; ``nn.MultiheadAttention``, RNNs: ``dropout``). A
    heuristic, found by testers: a module applying another rule only in training is not seen."""
    if isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats:
        return True
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, torch.nn.RReLU):
        return True
    return any(
        any(word in key for word in ("drop", "jitter", "noise"))  # dropout, drop_prob, layerdrop, router_jitter_noise
        and isinstance(rate := _rate(value), numbers.Real)
        and not isinstance(rate, numbers.Integral)  # a rate, not a count (num_noise_tokens) nor a flag
        and rate > 0
        for key, value in vars(module).items()
    )


def _attention_mask_of(module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The ``attention_mask`` argument of the call ``module(*args, **kwargs)``, however it was passed.

    The arguments are bound to ``module.forward``'s signature, so ``student(ids, mask)`` finds ``mask`` as well as
    ``student(input_ids=ids, attention_mask=mask)`` does (a positional mask was ignored and the KD term averaged
    over padding too, found by a tester); a mask in a ``**kwargs`` catch-all is found by name.

    Returns:
        The mask as passed (typically an int/bool tensor ``[batch, seq]``), or ``None`` when the call has none or its
        arguments do not bind to the signature (then only a keyword ``attention_mask`` is found).
    """
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):  # no signature, or the call does not fit it
        return kwargs.get("attention_mask")
    if "attention_mask" in bound.arguments:
        return bound.arguments["attention_mask"]
    for name, parameter in bound.signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return bound.arguments.get(name, {}).get("attention_mask")
    return None


def _rate(value: Any) -> Any:
    """A 0-d tensor or array (``torch.tensor(0.3)``, ``np.array(0.3)``) as its number; others as given."""
    is_scalar = isinstance(value, torch.Tensor) or type(value).__module__ == "numpy"
    return value.item() if is_scalar and getattr(value, "ndim", None) == 0 else value


@attrs.define(kw_only=True, slots=False, eq=False)
class OutputDistillationModifier(Modifier):
    """Add a KL term between temperature-scaled teacher and student logits to the loss (Hinton et al. 2015).

    Recipe arguments:

    - ``temperature`` (default ``2.0``, > 0): both logits are divided by it before the
      softmax; the KL term is multiplied by ``temperature**2``.
    - ``alpha`` (default ``0.5``, in ``[0, 1]``): weight of the distillation term;
      the loss becomes ``(1 - alpha) * student_loss + alpha * T**2 * KL``
      (``alpha=1``: distillation only; ``alpha=0``: the student loss unchanged).
    - ``start`` / ``end`` (epochs): when distillation is active (default: always).

    Requires state ``model`` (the student) and ``teacher``, models whose output holds logits for the student's
    inputs (:func:`logits_of`; a transformers encoder-decoder model or base model without a head is refused at
    initialize), with output vocabularies of one size (checked at initialize where both tell it:
    :func:`vocabulary_size`). The teacher is put in
    eval mode at initialize and run under ``torch.no_grad()`` on the student's last inputs;
    finalize (or a reset) gives each of its modules back the training mode it had before initialize. A teacher
    shared by modifiers of several live sessions stays in eval mode until the last of them is finalized or reset,
    which gives back the modes it had before the first one was initialized.
    After each loss, :attr:`last_student_loss` and :attr:`last_distill_loss` hold
    the two terms (detached).

    Raises:
        ValueError: ``temperature`` not > 0 or ``alpha`` outside ``[0, 1]`` (at construction).
    """

    required_state = frozenset({"model", "teacher"})
    events = frozenset({"batch_start", "loss_calculated"})

    temperature: float = attrs.field(default=2.0, converter=_float_not_bool, validator=_temperature)
    alpha: float = attrs.field(default=0.5, converter=_float_not_bool, validator=_alpha)

    last_student_loss: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)
    last_distill_loss: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)
    _captured: tuple[Any, Any, torch.Tensor, Any] | None = attrs.field(default=None, init=False, repr=False)
    #: the hook captures only from an active batch_start to the loss_calculated that consumes the capture (the last
    #: batch's logits and inputs were held before start and after end: vocab-sized, found by a tester)
    _armed: bool = attrs.field(default=False, init=False, repr=False)
    _teacher: Any = attrs.field(default=None, init=False, repr=False)
    _student: Any = attrs.field(default=None, init=False, repr=False)

    def on_initialize(self, state: State) -> None:
        """Put the teacher in eval mode (its modules' modes kept for finalize) and hook the student's forward to
        capture its inputs and logits.

        Raises:
            ValueError: the teacher is the student model itself, or shares modules with it (a peft model's
                ``get_base_model()`` as the teacher of the peft model: the distillation loss was 0 and putting the
                teacher in eval mode turned the student's dropout off, found by a tester); or the two output
                vocabularies differ in size (:func:`vocabulary_size`; it was refused only at the first
                ``loss_calculated``, found by a tester); or the student or the teacher is a transformers model that
                gives no logits for the student's inputs: an encoder-decoder model (``config.is_encoder_decoder``)
                or a base model without a head (``AutoModel`` instead of ``AutoModelForCausalLM``), refused only at
                the first step before (found by a tester).
        """
        if state.teacher is state.model:
            msg = (
                "the teacher is the student model itself (a peft model's get_base_model() is the model its adapters "
                "are in); pass a separate (e.g. dense, frozen) copy as teacher"
            )
            raise ValueError(msg)
        shared = _shared_with_student(state.model, state.teacher)
        if shared:
            msg = (
                f"the teacher shares the student's {compact_names(shared)} (trained parameters, or a module whose "
                "forward depends on its training mode): its logits would follow the student's training, or putting "
                "it in eval mode would change the student's; pass a separate copy as teacher (e.g. copy.deepcopy of "
                "the model before adding adapters, or the checkpoint loaded again)"
            )
            raise ValueError(msg)
        for model, role in ((state.model, "student"), (state.teacher, "teacher")):
            reason = _no_logits_reason(model, role)
            if reason is not None:
                raise ValueError(reason)
        student_size, teacher_size = vocabulary_size(state.model), vocabulary_size(state.teacher)
        if student_size is not None and teacher_size is not None and student_size != teacher_size:
            msg = (
                f"the student's output vocabulary has {student_size} tokens and the teacher's {teacher_size} "
                "(output embeddings): distillation compares their logits token by token, so both need the same "
                "vocabulary size (a shared tokenizer is not enough when one model's embeddings were padded to "
                "another size); pass a teacher whose output size is the student's, or resize one model's embeddings "
                "(resize_token_embeddings) to match"
            )
            raise ValueError(msg)
        self.last_student_loss = self.last_distill_loss = None  # read-outs of this run only
        self._teacher = state.teacher
        self._student = state.model
        self.register_hook(state.model, self._capture, kind="forward", with_kwargs=True)
        _hold_teacher(self._teacher, self)  # last: nothing after it can fail (a failed on_initialize is not finalized)

    def _capture(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        # ``module is self._student``: a deep copy of the student (an EMA or ``AveragedModel`` copy) carries this
        # hook in its copied ``_forward_hooks``; its forwards must not replace the student's logits (found by a
        # tester: the distillation term was computed on the copy's logits and its gradient went to the copy).
        if self._armed and module is self._student and module.training and torch.is_grad_enabled():
            self._captured = (args, kwargs, logits_of(output), _attention_mask_of(module, args, kwargs))

    def on_event(self, state: State, event: Event) -> torch.Tensor | None:
        if event.type == "batch_start":
            self._captured = None
            self._armed = True
            return None
        captured, self._captured, self._armed = self._captured, None, False
        if captured is None:
            msg = (
                "OutputDistillationModifier: loss_calculated() came without a training forward pass of the "
                "student (state.model) since batch_start(), so the loss was left unchanged (no distillation); "
                "call model(...) in train mode, with gradients enabled, before session.loss_calculated(loss)"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            return None
        args, kwargs, student_logits, attention_mask = captured
        teacher_kwargs = {k: v for k, v in kwargs.items() if k not in _NOT_INPUTS}
        where = model_device(self._teacher)
        if where is not None:  # the teacher computes on its own device (tensors already there are not copied)
            args, teacher_kwargs = to_device(args, where), to_device(teacher_kwargs, where)
        with torch.no_grad():
            teacher_logits = logits_of(self._teacher(*args, **teacher_kwargs))
        kd = distillation_kl(student_logits, teacher_logits, self.temperature, attention_mask)
        loss = event.loss
        if not isinstance(loss, torch.Tensor):  # a number is a loss too (loss_calculated takes one)
            loss = torch.tensor(float(loss), dtype=kd.dtype, device=kd.device)
        self.last_student_loss = loss.detach()
        self.last_distill_loss = kd.detach()
        return (1.0 - self.alpha) * loss + self.alpha * kd.to(loss.dtype)

    def on_finalize(self, state: State) -> None:
        if self._teacher is not None:  # the teacher's modes as the caller gave them, once no live session uses it
            _release_teacher(self._teacher, self)
        self._captured = None
        self._armed = False
        self._teacher = None
        self._student = None

    def state_dict(self) -> dict[str, Any]:
        """The distillation settings (``temperature``, ``alpha``) and the last two loss terms (tensors or ``None``)."""
        return {
            "temperature": self.temperature,
            "alpha": self.alpha,
            "last_student_loss": self.last_student_loss,
            "last_distill_loss": self.last_distill_loss,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` after ``on_initialize``.

        Raises:
            ValueError: the checkpoint's temperature or alpha differs from this modifier's.
        """
        for name in ("temperature", "alpha"):
            saved = state.get(name, getattr(self, name))
            if saved != getattr(self, name):
                msg = f"{name} is {saved} in the checkpoint, {getattr(self, name)} in this recipe"
                raise ValueError(msg)
        device = model_device(self._student)
        for name in ("last_student_loss", "last_distill_loss"):  # read on the CPU; held on the student's device
            value = state.get(name)
            setattr(self, name, value.to(device) if isinstance(value, torch.Tensor) and device is not None else value)
