"""The one-shot job: :func:`llmc_fsm.oneshot`, its phases, data, streaming variant and resume."""

__all__: list[str] = []
