"""Grouped ("true sequential") calibration: one forward per layer, each group of targets compressed before it runs."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import GROUPS, llama
from torch import nn

from llmc_fsm import ModifierError, Session
from llmc_fsm.core.torch_hooks import hook_count
from llmc_fsm.pipeline.forward import record_calls
from llmc_fsm.pipeline.sequential import run_sequential
from llmc_fsm.pipeline.true_sequential import plan_groups, run_grouped


@pytest.fixture
def data() -> torch.Tensor:
    return torch.randint(0, 128, (6, 16), generator=torch.Generator().manual_seed(1))


def _sparsegpt_session(model, data) -> Session:
    session = Session({"stage": {"SparseGPTModifier": {"sparsity": 0.5}}})
    session.initialize(model=model, calibration_data=data)
    return session


def _short(module_names: list[str]) -> list[str]:
    return [name.rsplit(".", 1)[-1] for name in module_names]


def test_each_group_is_compressed_at_its_own_event_in_call_order(data):
    model = llama(layers=2)
    names = {id(m): n for n, m in model.named_modules()}
    session = _sparsegpt_session(model, data)
    modifier = session.modifiers[0]
    events: list[list[str]] = []
    compressed_before: list[int] = []
    original = type(modifier).on_sequential_epoch_end

    def spy(state, modules):
        events.append([names[id(m)] for m in modules])
        compressed_before.append(len(modifier.results))
        original(modifier, state, modules)

    modifier.on_sequential_epoch_end = spy
    run_sequential(session, batch_size=4, progress=False)  # 2 batches
    session.finalize()
    expected = []
    for i in range(2):
        expected += [[f"model.layers.{i}.{name}" for name in group] for group in GROUPS]
        expected.append([f"model.layers.{i}"])
    assert events == expected
    # each group event compresses exactly its members; the layer event finds nothing left
    assert compressed_before == [0, 3, 4, 6, 7, 7, 10, 11, 13, 14]
    assert len(modifier.results) == 14


def test_group_members_share_one_accumulator_fed_once_per_batch(data):
    model = llama(layers=1)
    session = _sparsegpt_session(model, data)
    modifier = session.modifiers[0]
    created: list[str] = []
    new_accumulator = modifier._new_accumulator

    def spy(module):
        created.append(type(module).__name__)
        return new_accumulator(module)

    modifier._new_accumulator = spy
    run_sequential(session, batch_size=2, progress=False)  # 3 batches
    session.finalize()
    assert len(created) == 4  # q/k/v, o, gate/up, down
    results = modifier.results
    assert {r.samples for r in results.values()} == {data.numel()}  # every token exactly once, shared or not


def test_plan_groups_falls_back_to_the_plain_order():
    model = llama(layers=1)
    layer = model.model.layers[0]
    x = torch.randn(1, 4, model.config.hidden_size)
    pos = model.model.rotary_emb(x, torch.arange(4)[None])
    calls = record_calls(layer, (x,), {"position_embeddings": pos, "attention_mask": None})
    assert plan_groups(layer, calls) is None  # nothing hooked
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    handles = [m.register_forward_pre_hook(lambda m, a: None) for m in linears]
    groups = plan_groups(layer, calls)
    assert [[n for n, m in layer.named_modules() if any(m is g for g in group)] for group in groups] == [
        list(group) for group in GROUPS
    ]
    post = layer.mlp.down_proj.register_forward_hook(lambda m, a, out: None)
    assert plan_groups(layer, calls) is None  # someone observes an output
    post.remove()
    parent = layer.mlp.register_forward_pre_hook(lambda m, a: None)
    assert plan_groups(layer, calls) is None  # a hooked module that is not a leaf
    parent.remove()
    assert plan_groups(layer, [c for c in calls if not c[0].endswith("up_proj")]) is None  # never called
    assert plan_groups(layer, None) is None
    for handle in handles:
        handle.remove()


class _Branchy(nn.Module):
    """``b`` runs only for inputs whose first entry is positive: the forward depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) if x.flatten()[0] > 0 else y


def test_a_batch_that_skips_a_group_stops_the_layer_with_a_clear_error():
    layer = _Branchy()
    seen: list[int] = []
    for module in (layer.a, layer.b):
        module.register_forward_pre_hook(lambda m, a: seen.append(1))
    inputs = [((torch.ones(1, 4),), {}), ((-torch.ones(1, 4),), {})]
    compressed: list[list[nn.Module]] = []
    before = {m: hook_count(m) for m in (layer.a, layer.b)}
    with pytest.raises(
        RuntimeError, match=r"calibration batch 1 did not reach .* \(at group 2 of 2\).*true_sequential=False"
    ):
        run_grouped(layer, inputs, [[layer.a], [layer.b]], compressed.append)
    assert compressed == [[layer.a]]  # b was never compressed
    assert {m: hook_count(m) for m in (layer.a, layer.b)} == before  # the pipeline's own hooks are gone


def test_an_error_while_compressing_a_group_unwinds_every_batch(data):
    model = llama(layers=2)
    session = _sparsegpt_session(model, data)
    modifier = session.modifiers[0]
    o_proj = model.model.layers[0].self_attn.o_proj
    original = type(modifier)._compress_group
    finally_ran: list[int] = []

    def failing(modules, acc):
        if o_proj in modules:
            raise ValueError("boom in o_proj")
        return original(modifier, modules, acc)

    modifier._compress_group = failing
    layer = model.model.layers[0]
    forward = layer.self_attn.forward

    def tracked(*args, **kwargs):  # a batch suspended inside the attention unwinds through here
        try:
            return forward(*args, **kwargs)
        finally:
            finally_ran.append(1)

    layer.self_attn.forward = tracked
    with pytest.raises(ModifierError, match="boom in o_proj"):
        run_sequential(session, batch_size=4, progress=False)  # 2 batches
    assert len(finally_ran) == 1 + 2  # the recorded forward, then both suspended batches unwound
    assert hook_count(o_proj, ("forward_pre",)) == 1  # only the modifier's own hook is left (removed at finalize)
    assert hook_count(layer.self_attn.q_proj, ("forward_pre",)) == 1


def test_a_modifier_that_is_not_calibrated_keeps_the_plain_order(data):
    model = llama(layers=2)
    calls = {"up": 0}
    forward = model.model.layers[0].mlp.up_proj.forward

    def counted(*args, **kwargs):
        calls["up"] += 1
        return forward(*args, **kwargs)

    model.model.layers[0].mlp.up_proj.forward = counted
    session = Session(
        {
            "stage": {
                "SparseGPTModifier": {"sparsity": 0.5},
                "MagnitudePruningModifier": {
                    "init_sparsity": 0.0,
                    "final_sparsity": 0.0,
                    "start": 0,
                    "end": 1,
                    "update": 1,
                },
            }
        }
    )
    session.initialize(model=model, calibration_data=data, steps_per_epoch=1)
    run_sequential(session, batch_size=4, progress=False)
    session.finalize()
    assert calls["up"] == 1 + 2 + 2  # recorded forward, 2 calibration runs, 2 propagation runs (grouped: 1 + 2)
