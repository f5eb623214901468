"""The sequential calibration pipeline and the calibrated pruning modifiers on a tiny random Llama."""

from __future__ import annotations

import copy

import re

import pytest
import torch
from llmc_fsm_pruning import sparsegpt_prune, wanda_mask
from tiny_llama import GROUPS, LINEARS, llama

import llmc_fsm
from llmc_fsm import MissingStateError, ModifierError, RecipeError, Session
from llmc_fsm.models.layers import find_decoder_layers
from llmc_fsm.pipeline.sequential import calibration_batches, run_sequential


@pytest.fixture
def data() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (6, 16), generator=g)


def sparsegpt(**kw):
    return {"stage": {"SparseGPTModifier": {"sparsity": 0.5, **kw}}}


def linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}


def test_find_decoder_layers():
    model = llama(layers=3)
    name, layers = find_decoder_layers(model)
    assert name == "model.layers"
    assert layers is model.model.layers


def test_layer_inputs_match_a_full_forward_for_a_dense_model(data):
    """With a modifier that changes nothing, each layer sees exactly what a full forward feeds it."""
    model = llama(layers=3)
    layers = model.model.layers
    expected: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}
    handles = [
        layer.register_forward_pre_hook(
            lambda m, a, k, i=i: expected[i].append((a[0] if a else k["hidden_states"]).clone()), with_kwargs=True
        )
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        for chunk in data.split(4):
            model(input_ids=chunk, use_cache=False)
    for h in handles:
        h.remove()

    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}
    handles = [
        layer.register_forward_pre_hook(
            lambda m, a, k, i=i: seen[i].append((a[0] if a else k["hidden_states"]).clone()), with_kwargs=True
        )
        for i, layer in enumerate(layers)
    ]
    session = Session(sparsegpt(sparsity=0.0))  # sparsity 0: weights unchanged
    session.initialize(model=model, calibration_data=data)
    result = run_sequential(session, batch_size=4, progress=False)
    session.finalize()
    for h in handles:
        h.remove()
    assert result.num_layers == 3 and result.num_batches == 2
    for i in range(len(layers)):
        # layer 0: the capture run (2 batches) and the recorded forward (batch 0); then every
        # layer one pass of 2 batches (true sequential: calibration and propagation in one)
        runs = seen[i]
        assert len(runs) == {0: 5, 1: 2, 2: 2}[i]
        for j, x in enumerate(runs if i else runs[:2] + runs[3:]):
            torch.testing.assert_close(x, expected[i][j % 2], rtol=1e-5, atol=1e-5)
        if i == 0:
            torch.testing.assert_close(runs[2], expected[0][0], rtol=1e-5, atol=1e-5)


def _plain_forward_inputs(model, data: torch.Tensor, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{name in layer: float64 [tokens, in]}``: what each Linear of ``layer`` sees in a plain forward of the model."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [
        module.register_forward_pre_hook(
            lambda m, args, name=name: seen.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1]).double())
        )
        for name, module in layer.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    try:
        with torch.no_grad():
            for chunk in data.split(4):
                model(input_ids=chunk, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(xs) for name, xs in seen.items()}


@pytest.mark.parametrize("true_sequential", [True, False])
@pytest.mark.parametrize(
    ("name", "structure"),
    [("SparseGPTModifier", "unstructured"), ("SparseGPTModifier", "2:4"), ("WandaPruningModifier", "unstructured")],
)
def test_pruned_weights_follow_from_a_plain_forward_through_the_pruned_earlier_modules(
    name, structure, true_sequential
):
    """Each module's weight is the algorithm applied to the statistics of a plain forward of the
    calibration data through the model whose earlier decoder layers are already pruned — and, true
    sequential, whose earlier groups in the same layer too; the statistics the modifier accumulated
    equal those statistics by value."""
    data = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(2))  # 256 tokens
    model = llama(layers=3)
    reference = copy.deepcopy(model)  # dense; pruned below layer by layer, by the algorithm alone
    session = Session({"stage": {name: {"sparsity": 0.5, "mask_structure": structure}}})
    modifier = session.modifiers[0]
    accumulators: dict[int, object] = {}  # id(module) -> the accumulator created for it
    new_accumulator = modifier._new_accumulator

    def spy(module):
        accumulators[id(module)] = acc = new_accumulator(module)
        return acc

    modifier._new_accumulator = spy
    session.initialize(model=model, calibration_data=data)
    run_sequential(session, batch_size=3, progress=False, true_sequential=true_sequential)
    session.finalize()

    compared = 0
    groups = GROUPS if true_sequential else [LINEARS]
    for pruned_layer, ref_layer in zip(model.model.layers, reference.model.layers, strict=True):
        for group in groups:
            inputs = _plain_forward_inputs(reference, data, ref_layer)
            assert len(inputs) == 7
            new_weights = {}
            for rel in group:
                x = inputs[rel]
                dense = ref_layer.get_submodule(rel).weight.detach()
                acc = accumulators.get(id(pruned_layer.get_submodule(rel)))
                if name == "SparseGPTModifier":
                    h = 2.0 / x.shape[0] * x.T @ x
                    if acc is not None:
                        assert acc.num_samples == x.shape[0] == data.numel()
                        diff = float((acc.hessian.double() - h).abs().max())
                        assert diff <= 1e-5 * float(h.abs().max()), (rel, diff)
                        compared += 1
                    expected, keep = sparsegpt_prune(dense, h.float(), sparsity=0.5, mask_structure=structure)
                else:
                    sq = (x**2).sum(dim=0)
                    if acc is not None:
                        assert acc.num_samples == x.shape[0]
                        diff = float((acc.sq_norm.double() - sq).abs().max())
                        assert diff <= 1e-5 * float(sq.max()), (rel, diff)
                        compared += 1
                    keep = wanda_mask(dense, sq, 0.5, structure)
                    expected = dense * keep
                got = pruned_layer.get_submodule(rel).weight.detach()
                assert torch.equal(got != 0, keep), f"{rel}: {int(((got != 0) != keep).sum())} mask entries differ"
                assert float((got - expected).abs().max()) <= 1e-4 * float(dense.abs().max()), rel  # measured <= 1.8e-5
                new_weights[rel] = expected
            with torch.no_grad():  # later groups' and layers' plain forwards run through these pruned modules
                for rel, w in new_weights.items():
                    ref_layer.get_submodule(rel).weight.copy_(w)
    # every distinct input (q/k/v, o, gate/up, down) of every layer was compared
    assert compared >= 4 * 3


@pytest.mark.parametrize("name", ["SparseGPTModifier", "WandaPruningModifier"])
def test_exact_unstructured_sparsity_and_tied_embedding_untouched(name, data):
    model = llama()
    embed_before = model.model.embed_tokens.weight.clone()
    session = Session({"stage": {name: {"sparsity": 0.5, "ignore": ["lm_head"]}}})
    session.initialize(model=model, calibration_data=data)
    run_sequential(session, batch_size=4, progress=False)
    session.finalize()
    for n, m in linears(model).items():
        zeros = int((m.weight == 0).sum())
        assert zeros == m.weight.numel() // 2, n
        if name == "WandaPruningModifier":  # Wanda: exactly half of every output row
            assert ((m.weight == 0).sum(dim=1) == m.weight.shape[1] // 2).all(), n
        else:  # SparseGPT: the mask is chosen over whole blocks, so rows differ
            assert len(set((m.weight == 0).sum(dim=1).tolist())) > 1, n
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, embed_before)
    assert session.modifiers[0].skipped == []
    assert len(session.modifiers[0].results) == 14


@pytest.mark.parametrize("name", ["SparseGPTModifier", "WandaPruningModifier"])
def test_two_four_pattern(name, data):
    model = llama()
    session = Session({"stage": {name: {"mask_structure": "2:4"}}})
    session.initialize(model=model, calibration_data=data)
    run_sequential(session, batch_size=3, progress=False)
    session.finalize()
    for n, m in linears(model).items():
        groups = (m.weight == 0).reshape(m.weight.shape[0], -1, 4).sum(dim=-1)
        assert (groups >= 2).all(), n


def test_sparsegpt_beats_wanda_on_layer_error(data):
    """SparseGPT's weight reconstruction gives a smaller output change than Wanda's mask alone."""
    outs = {}
    for name in ("SparseGPTModifier", "WandaPruningModifier"):
        model = llama()
        with torch.no_grad():
            dense = model(input_ids=data).logits
        session = Session({"stage": {name: {"sparsity": 0.5}}})
        session.initialize(model=model, calibration_data=data)
        run_sequential(session, progress=False)
        session.finalize()
        with torch.no_grad():
            outs[name] = float((model(input_ids=data).logits - dense).pow(2).mean())
    assert outs["SparseGPTModifier"] < outs["WandaPruningModifier"]


def test_missing_calibration_data_is_reported_at_initialize_before_work():
    model = llama()
    before = {n: p.clone() for n, p in model.named_parameters()}
    session = Session(sparsegpt())
    with pytest.raises(MissingStateError, match=r"\n  - SparseGPTModifier requires 'calibration_data'\n") as info:
        session.initialize(model=model)
    assert info.value.missing == {"SparseGPTModifier": frozenset({"calibration_data"})}
    assert session.lifecycle == "created"
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_targets_matching_nothing_name_targets_and_modules(data):
    model = llama()
    session = Session(sparsegpt(targets=["Conv2d", "re:.*nothing.*"]))
    nothing = r"\('Conv2d': it matches no module; 're:\.\*nothing\.\*': it matches no module\)"
    with pytest.raises(ModifierError, match=nothing) as info:
        session.initialize(model=model, calibration_data=data)
    assert "Linear-like modules: model.layers.0.self_attn.q_proj" in str(info.value)  # what could be targeted


def test_targets_outside_the_layers_are_refused_before_work(data):
    """A module outside the decoder layers other than the output head (calibrated after the last layer when
    targeted: plugins/quantization/tests/test_output_head.py) is refused, e.g. a multimodal projector."""
    model = llama()
    model.model.projector = torch.nn.Linear(64, 64)  # outside the decoder layers, never called by the forward
    before = model.model.layers[0].self_attn.q_proj.weight.clone()
    session = Session(sparsegpt(ignore=["lm_head"]))  # model.projector is now a target
    session.initialize(model=model, calibration_data=data)
    message = (
        "SparseGPTModifier targets model.projector, outside the decoder layers (model.layers); the sequential pipeline "
        "calibrates only the decoder layers and the output head. Add them to the modifier's ignore list."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        run_sequential(session, progress=False)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"sparsity": 1.5}, r"'sparsity': sparsity must be a number in \[0, 1\) .*, got 1\.5$"),
        ({"sparsity": -0.1}, r"'sparsity': sparsity must be a number in \[0, 1\) .*, got -0\.1$"),
        ({"mask_structure": "4:2"}, r"'mask_structure': invalid mask_structure '4:2': expected "),
        ({"block_size": 0}, r"'block_size': block_size must be a positive int, got 0$"),
        ({"dampening_frac": -0.1}, r"'dampening_frac': dampening_frac must be a number in \[0, 1e\+06\], got -0.1 "),
        ({"dampening_frac": 1e9}, r"'dampening_frac': dampening_frac must be .* got 1000000000.0 \(relative "),
        (
            {"mask_structure": "2:4", "block_size": 30},
            r"'block_size': block_size \(30\) must be a multiple of M=4 for mask_structure '2:4'$",
        ),
    ],
)
def test_bad_arguments_fail_at_session_creation(args, match):
    where = r"^recipe <dict>, stage 'stage', modifier SparseGPTModifier, argument "
    with pytest.raises(RecipeError, match=where) as info:
        Session({"stage": {"SparseGPTModifier": args}})
    assert info.match(match)


def test_modifier_without_sequential_events_prunes_at_calibration_end(data):
    """An integration that runs the whole model between calibration_start and calibration_end."""
    model = llama()
    session = Session(sparsegpt())
    session.initialize(model=model, calibration_data=data)
    session.calibration_start()
    with torch.no_grad():
        model(input_ids=data)
    session.calibration_end()
    session.finalize()
    for n, m in linears(model).items():
        assert int((m.weight == 0).sum()) == m.weight.numel() // 2, n
    assert session.modifiers[0].num_hooks == 0


def test_hessians_are_shared_between_modules_with_the_same_input(data):
    model = llama(layers=1)
    session = Session(sparsegpt())
    session.initialize(model=model, calibration_data=data)
    session.calibration_start()
    with torch.no_grad():
        model(input_ids=data)
    mod = session.modifiers[0]
    accs = mod._acc
    attn = model.model.layers[0].self_attn
    assert accs["model.layers.0.self_attn.q_proj"] is accs["model.layers.0.self_attn.k_proj"]
    assert accs["model.layers.0.self_attn.q_proj"] is accs["model.layers.0.self_attn.v_proj"]
    assert accs["model.layers.0.self_attn.q_proj"] is not accs["model.layers.0.self_attn.o_proj"]
    assert accs["model.layers.0.mlp.gate_proj"] is accs["model.layers.0.mlp.up_proj"]
    assert accs["model.layers.0.self_attn.q_proj"].num_samples == data.numel()
    assert attn is not None
    session.calibration_end()
    session.finalize()


def _count_calls(module: torch.nn.Module, counts: dict, key: str) -> None:
    """Count forward calls without a hook (a hook would change what the pipeline may skip)."""
    forward = module.forward

    def counted(*args, **kwargs):
        counts[key] = counts.get(key, 0) + 1
        return forward(*args, **kwargs)

    module.forward = counted


@pytest.mark.parametrize(("true_sequential", "early_exit"), [(True, True), (False, True), (False, False)])
def test_forward_calls_per_layer(data, true_sequential, early_exit):
    model = llama(layers=2)
    counts: dict[str, int] = {}
    for i, layer in enumerate(model.model.layers):
        _count_calls(layer.mlp.down_proj, counts, f"down{i}")
        _count_calls(layer.mlp.up_proj, counts, f"up{i}")
    session = Session(sparsegpt())
    session.initialize(model=model, calibration_data=data)
    run_sequential(session, batch_size=4, progress=False, early_exit=early_exit, true_sequential=true_sequential)
    session.finalize()
    # layer 0 first runs one batch whole, before any hook (the recorded call order) — not when nothing uses it
    if true_sequential:  # then one pass of both batches per layer (up_proj's statistics come from gate_proj's call)
        assert counts == {"down0": 1 + 2, "up0": 1 + 2, "down1": 2, "up1": 2}
    elif early_exit:  # 2 calibration runs stop at down_proj's input, 2 propagation runs (none after the last layer)
        assert counts == {"down0": 1 + 2, "up0": 1 + 2 + 2, "up1": 2}
    else:
        assert counts == {"down0": 2 + 2, "up0": 2 + 2, "down1": 2, "up1": 2}


def test_early_exit_gives_the_same_weights_as_running_whole_layers(data):
    pruned = []
    for early_exit in (True, False):
        model = llama(layers=3)
        session = Session(sparsegpt())
        session.initialize(model=model, calibration_data=data)
        run_sequential(session, batch_size=4, progress=False, early_exit=early_exit, true_sequential=False)
        session.finalize()
        pruned.append({n: m.weight.detach().clone() for n, m in linears(model).items()})
    for name, weight in pruned[0].items():
        assert torch.equal(weight, pruned[1][name]), name


def test_a_forward_hook_after_the_last_pre_hook_keeps_the_whole_layer_running(data):
    """Someone observes down_proj's output: the calibration pass must not stop before it."""
    model = llama(layers=2)
    outputs: list[torch.Tensor] = []
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: outputs.append(out))
    session = Session(sparsegpt())
    session.initialize(model=model, calibration_data=data)
    run_sequential(session, batch_size=4, progress=False)
    session.finalize()
    assert len(outputs) == 2  # both calibration batches of the last layer


def test_calibration_batches_forms():
    ids = torch.arange(20).view(5, 4)
    assert [b["input_ids"].shape[0] for b in calibration_batches(ids, batch_size=2)] == [2, 2, 1]
    assert len(calibration_batches([ids[:2], {"input_ids": ids[2:]}])) == 2
    with pytest.raises(ValueError, match=r"^calibration data is empty: give at least one batch of token ids$"):
        calibration_batches([])
    with pytest.raises(ValueError, match=r"^calibration tensor must be integer token ids of shape \[N, L\], got "):
        calibration_batches(torch.zeros(2, 3))


@pytest.mark.parametrize("output_layers", [0, 1])
def test_a_model_looping_over_its_decoder_layers_is_refused_before_any_work(output_layers):
    """B1's case (session 30): Dory runs its recurrent layers n_recurrent_loops times. With a layer after the loop the
    repeated call was refused ("calls decoder layer 1 twice"); a loop through the last layer went unseen (the capture
    ends there), and the second pass was never calibrated. Both are refused from the config, before any work."""
    transformers = pytest.importorskip("transformers")
    from tiny_families import _TEXT

    config = transformers.AutoConfig.for_model(
        "dory", **_TEXT, n_input_layers=1, n_recurrent_layers=3 - output_layers, n_output_layers=output_layers,
        n_recurrent_loops=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError) as info:
        llmc_fsm.oneshot(model=model, dataset=torch.randint(3, 128, (4, 16)), progress=False)
    assert str(info.value) == (
        "the forward of DoryForCausalLM (model_type 'dory') runs its recurrent decoder layers 2 times "
        "(n_recurrent_loops in its config); the sequential pipeline gives each layer the inputs of one call (until "
        "2026-12-06 a loop through the last layer was calibrated on the first pass only: a tester's case)"
    )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
