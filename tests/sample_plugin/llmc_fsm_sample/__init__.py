"""llmc-fsm-sample: a third-party modifier plugin used by the llmc-fsm tests and docs."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from llmc_fsm import Event, Modifier, State, hookimpl

__all__ = ["SampleMagnitudeMask", "llmc_fsm_register_modifiers"]


def _fraction(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value < 1.0:
        msg = f"{attribute.name} must be in [0, 1), got {value}"
        raise ValueError(msg)


@attrs.define(kw_only=True, slots=False, eq=False)
class SampleMagnitudeMask(Modifier):
    """Zero the smallest-magnitude fraction of every Linear weight and keep it zero after each step."""

    required_state: ClassVar[frozenset[str]] = frozenset({"model"})
    events: ClassVar[frozenset[str]] = frozenset({"optim_post_step"})

    fraction: float = attrs.field(default=0.5, converter=float, validator=_fraction)
    calls: int = attrs.field(default=0, init=False)

    def on_initialize(self, state: State) -> None:
        import torch

        self._masks: list[tuple[Any, Any]] = []
        for module in state.model.modules():
            if isinstance(module, torch.nn.Linear):
                weight = module.weight.detach()
                k = int(weight.numel() * self.fraction)
                mask = torch.ones_like(weight, dtype=torch.bool)
                if k:
                    threshold = weight.abs().flatten().kthvalue(k).values
                    mask = weight.abs() > threshold
                self._masks.append((module, mask))
                self.register_hook(module, self._count, kind="forward")
        self._apply()

    def _count(self, module: Any, args: Any, output: Any) -> None:
        self.calls += 1

    def _apply(self) -> None:
        import torch

        with torch.no_grad():
            for module, mask in self._masks:
                module.weight.mul_(mask)

    def on_event(self, state: State, event: Event) -> None:
        self._apply()

    def on_finalize(self, state: State) -> None:
        self._masks = []


@hookimpl
def llmc_fsm_register_modifiers() -> list[type[Modifier]]:
    return [SampleMagnitudeMask]
