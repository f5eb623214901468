"""A session inside the training ecosystem's wrappers: peft (LoRA), AveragedModel, accelerate's gradient
accumulation, a teacher sharing the student's modules, and the default ``ignore: [lm_head]`` under a wrapper.

Each case was found by a tester embedding a session in training code (session 28): LoRA's zero-initialised B was
masked (frozen), the head of a wrapped model was pruned silently, a resumed peft run differed from the uninterrupted
one, a teacher sharing the student's modules gave a distillation loss of 0, accelerate's idiom ran every schedule at
the accumulation factor's speed, and an AveragedModel given as the model was pruned instead of the trained model.
"""

from __future__ import annotations

import copy
import logging

import pytest
import tiny_llama
import torch

peft = pytest.importorskip("peft")  # a test dependency (setup.cfg [test]); not needed by the library

from llmc_fsm_pruning import ConstantPruningModifier, MagnitudePruningModifier  # noqa: E402
from llmc_fsm_training import OutputDistillationModifier  # noqa: E402

from llmc_fsm import ModifierError, Session  # noqa: E402
from llmc_fsm.integrations.torch import initialize, optimizer_step  # noqa: E402

VOCAB = 64
LORA = ("q_proj", "v_proj", "up_proj")


def _llama(seed: int = 0):
    model = tiny_llama.llama(seed=seed, vocab=VOCAB, kv_heads=4, tied=False)
    model.train()
    return model


def _lora(model):
    config = peft.LoraConfig(r=4, target_modules=list(LORA), lora_dropout=0.0, init_lora_weights=True)
    return peft.get_peft_model(model, config)


def _half_zero(model) -> None:
    """Half of the weights of every decoder-layer Linear, drawn at random, set to 0 (ConstantPruning holds those
    zeros; a regular pattern would zero whole input columns, whose outputs then get no gradient)."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                flat = module.weight.view(-1)
                flat[torch.randperm(flat.numel(), generator=g)[: flat.numel() // 2]] = 0


def _batches(n: int, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (2, 8), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _train(session: Session, model, optimizer, steps: int, seed: int = 5) -> None:
    for batch in _batches(steps, seed):
        session.batch_start(batch=batch)
        loss = session.loss_calculated(model(**batch).loss)
        loss.backward()
        optimizer_step(session, optimizer)
        session.batch_end()


# --------------------------------------------------------------------------- peft
@pytest.mark.parametrize("targets", [["Linear"], ["re:.*q_proj"], ["re:.*q_proj.weight"], ["re:.*q_proj$"]])
def test_peft_targets_resolve_to_the_base_layers_and_lora_trains(targets):
    """The session holds the peft model's base model (names without ``base_model.model.``); a target selects the base
    layer inside a LoRA layer, never the LoRA layer itself nor its A / B; the head stays out (default ignore); the
    LoRA weights train while the base weights keep their zeros."""
    model = _llama()
    _half_zero(model)
    peft_model = _lora(model)
    session = Session([ConstantPruningModifier(targets=targets)])
    trained = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    initialize(session, model=peft_model, optimizer=optimizer, steps_per_epoch=4)
    assert session.state.model is peft_model.get_base_model()
    selected = list(session.modifiers[0].resolved_targets)
    layer = "model.layers.{}.self_attn.q_proj.base_layer"
    if targets == ["Linear"]:
        expected = [
            f"model.layers.{i}.{part}{'.base_layer' if part.split('.')[1] in LORA else ''}"
            for i in range(2)
            for part in tiny_llama.LINEARS
        ]
        assert selected == expected
    else:
        assert selected == [layer.format(0), layer.format(1)]
    zeros = {n: (m.weight == 0).clone() for n, m in session.modifiers[0].resolved_targets.items()}
    _train(session, peft_model, optimizer, 3)
    for name, module in session.modifiers[0].resolved_targets.items():
        assert torch.equal(module.weight == 0, zeros[name])  # exactly the zeros held, no more
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and all(bool((p != 0).all()) for p in lora_b)  # B (initialised to 0) trained everywhere
    session.finalize()
    assert session.modifiers[0].measured_sparsity == 0.5


def test_a_pattern_naming_only_lora_layers_says_why_it_selects_nothing():
    session = Session([ConstantPruningModifier(targets=["re:.*lora_A.*"])])
    with pytest.raises(ModifierError) as info:
        session.initialize(model=_lora(_llama()))
    assert (
        "'re:.*lora_A.*': it matches only peft adapter layers (LoRA's A / B and the layers around a base_layer), "
        "which are never compressed: model.layers.0.self_attn.q_proj.lora_A (ModuleDict)" in str(info.value)
    )
    assert session.lifecycle == "created"


def test_a_resumed_peft_run_applies_the_saved_masks_before_its_first_step(tmp_path):
    """A peft checkpoint holds no base weights: the masks are applied when the session checkpoint loads, so the
    resumed run equals the uninterrupted one (the first resumed step computed on dense base weights)."""

    def run(resume: bool, steps: int):
        torch.manual_seed(0)
        peft_model = _lora(_llama())
        recipe = [MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.5, start=0, end=1, update=0.25)]
        session = Session(recipe)
        optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
        if resume:  # a new process: the base model from its original checkpoint (dense), the adapters saved
            peft.set_peft_model_state_dict(peft_model, torch.load(tmp_path / "adapter.pt"))
            optimizer.load_state_dict(torch.load(tmp_path / "optimizer.pt"))
            initialize(session, model=peft_model, optimizer=optimizer, steps_per_epoch=4, checkpoint=tmp_path / "s")
            base = session.modifiers[0].resolved_targets
            assert all(float((m.weight == 0).float().mean()) > 0.3 for m in base.values())  # masked before a step
            _train(session, peft_model, optimizer, steps, seed=9)
        else:
            initialize(session, model=peft_model, optimizer=optimizer, steps_per_epoch=4)
            _train(session, peft_model, optimizer, 3)
            session.save(tmp_path / "s")
            torch.save(peft.get_peft_model_state_dict(peft_model), tmp_path / "adapter.pt")
            torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
            _train(session, peft_model, optimizer, steps, seed=9)
        session.finalize()
        return {k: v.detach().clone() for k, v in peft_model.state_dict().items()}

    uninterrupted = run(False, 3)
    resumed = run(True, 3)
    assert sorted(resumed) == sorted(uninterrupted)
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


# --------------------------------------------------------------------------- wrappers the session does not unwrap
def test_an_averaged_model_given_as_the_model_is_refused():
    session = Session([MagnitudePruningModifier(sparsity=0.5)])
    model = _llama()
    with pytest.raises(ValueError) as info:
        session.initialize(model=torch.optim.swa_utils.AveragedModel(model))
    assert str(info.value) == (
        "the model is an AveragedModel (an EMA / SWA copy): its weights are averaged from the trained model's, not "
        "trained, so the modifiers would change the copy and not the model the optimizer trains; give the session "
        "that model (to compress the averaged weights themselves, give the copy's .module)"
    )
    assert session.lifecycle == "created"
    assert session.state.get("model") is None
    # as a teacher (a mean teacher) it is taken
    session = Session([OutputDistillationModifier()])
    teacher = torch.optim.swa_utils.AveragedModel(_llama(seed=1))
    session.initialize(model=model, teacher=teacher)
    assert session.state.teacher is teacher
    session.finalize()


class _Wrapper(torch.nn.Module):
    """A user's wrapper (a value head, a Lightning module): the model's head is ``model.lm_head``."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model


def test_the_default_ignore_that_misses_a_wrapped_head_is_said(caplog):
    """``lm_head`` is an exact name: under a user's wrapper the head is compressed, and the warning (silenced on a
    model without a head of that name) names it and the pattern that would match it."""
    wrapped = _Wrapper(_llama())
    session = Session([MagnitudePruningModifier(sparsity=0.5)])
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.targets"):
        session.initialize(model=wrapped)
    assert "model.lm_head" in session.modifiers[0].resolved_targets
    assert [r.getMessage() for r in caplog.records] == [
        "ignore pattern 'lm_head' matches no module, so model.lm_head is compressed: names are full module names; "
        "'re:.*lm_head$' would match it"
    ]
    session.finalize()
    caplog.clear()
    session = Session([MagnitudePruningModifier(sparsity=0.5)])
    with caplog.at_level(logging.WARNING, logger="llmc_fsm.toolkit.targets"):
        session.initialize(model=_llama())  # a head named lm_head: ignored, nothing said
    assert "lm_head" not in session.modifiers[0].resolved_targets
    assert caplog.records == []
    session.finalize()


# --------------------------------------------------------------------------- distillation
def test_a_teacher_sharing_the_students_modules_is_refused():
    student = _llama()
    peft_model = _lora(student)
    session = Session([OutputDistillationModifier()])
    with pytest.raises(ModifierError, match=r"the teacher is the student model itself \(a peft model's "):
        session.initialize(model=peft_model, teacher=peft_model.get_base_model())
    student = _llama()
    teacher = _Wrapper(student.model)  # the student's decoder, its own head
    teacher.lm_head = copy.deepcopy(student.lm_head)
    session = Session([OutputDistillationModifier()])
    with pytest.raises(ModifierError) as info:
        session.initialize(model=student, teacher=teacher)
    layer = "model.layers.{0..1}."
    shared = ", ".join(
        ["model.embed_tokens", *(layer + n for n in tiny_llama.LINEARS), layer + "input_layernorm",
         layer + "post_attention_layernorm", "model.norm"]
    )
    assert str(info.value).startswith(
        f"OutputDistillationModifier.on_initialize() raised ValueError: the teacher shares the student's {shared} "
        "(trained parameters, or a module whose forward depends on its training mode): its logits would follow the "
        "student's training, or putting it in eval mode would change the student's; pass a separate copy as teacher "
        "(e.g. copy.deepcopy of the model before adding adapters, or the checkpoint loaded again) (during "
        "initialize())"
    )
    assert session.lifecycle == "created"
    assert all(m.training for m in student.modules())  # eval() was not put on the shared modules
    # one shared trained parameter is enough (a tester's case); a frozen one, kept once to save memory, is taken
    teacher = _llama(seed=1)
    teacher.model.embed_tokens.weight = student.model.embed_tokens.weight
    with pytest.raises(ModifierError, match=r"the teacher shares the student's model\.embed_tokens \(trained "):
        Session([OutputDistillationModifier()]).initialize(model=student, teacher=teacher)
    student.model.embed_tokens.weight.requires_grad_(False)
    session = Session([OutputDistillationModifier()])
    session.initialize(model=student, teacher=teacher)
    session.finalize()


# --------------------------------------------------------------------------- accelerate
def test_accelerates_accumulation_idiom_counts_the_optimizer_steps_taken():
    """``optimizer_step`` on every micro-batch inside ``accelerator.accumulate``: the session's step events follow
    the optimizer's real steps (it counted every micro-batch, so the schedules ran twice as fast)."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # process-wide: a Trainer run earlier in the process
    GradientState._reset_state()  # (its own accumulation settings) would otherwise stay in force here
    model = _llama()
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0 / (1 + step))  # not prepared
    session = Session([MagnitudePruningModifier(init_sparsity=0.1, final_sparsity=0.5, start=0, end=1, update=0.25)])
    initialize(session, model=model, optimizer=optimizer, steps_per_epoch=4)  # 8 micro-batches, 4 steps
    steps, epochs = [], []
    for batch in _batches(8):
        with accelerator.accumulate(model):
            session.batch_start(batch=batch)
            loss = session.loss_calculated(model(**batch).loss)
            accelerator.backward(loss)
            optimizer_step(session, optimizer, scheduler=scheduler)
            session.batch_end()
        steps.append(session.global_step)
        epochs.append(session.modifiers[0].history[-1][0])
    assert steps == [0, 1, 1, 2, 2, 3, 3, 4]
    assert scheduler.last_epoch == 4  # it stepped at every micro-batch (8) before
    # one pruning step per optimizer step; the end (epoch 1.0) at the batch_end of the step that reached it
    assert epochs == [0.0, 0.0, 0.25, 0.25, 0.5, 0.5, 0.75, 1.0]
    session.finalize()


def test_oneshot_refuses_a_peft_model_before_any_work(tmp_path):
    """One-shot on a peft model ran with the wrapper's names and failed on its tied head (``base_model.model.lm_head
    shares its weight ...``); a compressed checkpoint has no place for adapters: refused in one line."""
    import llmc_fsm

    peft_model = _lora(_llama())
    injected = peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj"]), _llama())
    prompt = peft.get_peft_model(_llama(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    # PeftModel, its LoraModel, injected adapters, and a PeftModel without tuner layers (its save wrote the prompt
    # alone: a tester's case)
    for model in (peft_model, peft_model.base_model, injected, prompt):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError) as info:
            llmc_fsm.oneshot(model=model, dataset=torch.randint(0, VOCAB, (4, 16)), output_dir=tmp_path / "out")
        assert str(info.value) == (
            "model (--model) holds peft adapters (a PeftModel, its LoraModel or adapters injected into the model: "
            "beside the base weights, and a compressed checkpoint has no place for them): merge them first (model = "
            "model.merge_and_unload()), or compress the base model before adding adapters"
        )
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert list(tmp_path.iterdir()) == []


class _Block(torch.nn.Module):
    def __init__(self, *, attention_dropout: float = 0.0, dropout: float = 0.0) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(dropout)
        self.attention_dropout = attention_dropout  # as transformers' attention: applied when self.training


class _Net(torch.nn.Module):
    def __init__(self, block: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.block = block if block is not None else _Block()
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 4)


def test_the_teacher_sharing_rule_reads_storage_buffers_and_dropout_rates():
    """Testers' cases: a teacher sharing the student's weights by storage (``load_state_dict(assign=True)``) or its
    batch norm's running statistics was taken; a shared frozen attention block applying its dropout rate by
    ``self.training`` was taken (its eval mode turned the student's dropout off); a frozen block with dropout 0 was
    refused (nothing depends on the mode there)."""

    def refused(student, teacher) -> str | None:
        session = Session([OutputDistillationModifier()])
        try:
            session.initialize(model=student, teacher=teacher)
        except ModifierError as exc:
            return str(exc).split(" (trained parameters")[0].rpartition("the student's ")[2]
        session.finalize()
        return None

    student = _Net()
    by_storage = _Net()
    by_storage.load_state_dict(student.state_dict(), assign=True)
    assert refused(student, by_storage) == "block.proj, norm, head"
    statistics = _Net()
    statistics.norm.running_mean = student.norm.running_mean
    assert refused(student, statistics) == "norm"
    for rate, expected in ((0.5, "block"), (0.0, None)):
        frozen = _Block(attention_dropout=rate)
        frozen.requires_grad_(False)
        assert refused(_Net(frozen), _Net(frozen)) == expected
    frozen = _Block(dropout=0.1)
    frozen.requires_grad_(False)
    assert refused(_Net(frozen), _Net(frozen)) == "block.drop"
    # a router's jitter applied only in training (Mixtral, PhiMoE), also as a numpy rate; RReLU; instance norm's
    # running statistics (testers' cases)
    import numpy as np

    jitter = _Block()
    jitter.router_jitter_noise = np.float32(0.1)
    jitter.requires_grad_(False)
    assert refused(_Net(jitter), _Net(jitter)) == "block"
    for module in (torch.nn.RReLU(), torch.nn.InstanceNorm1d(4, track_running_stats=True)):
        assert refused(_Net(module), _Net(module)) == "block"
    layerdrop, counted, in_tensor = _Block(), _Block(), _Block()
    layerdrop.layerdrop, counted.num_noise_tokens = 0.5, 4  # a rate; a count is not one (testers' cases)
    in_tensor.attention_dropout = torch.tensor(0.3)  # a rate held in a 0-d tensor
    for block, expected in ((layerdrop, "block"), (counted, None), (in_tensor, "block")):
        block.requires_grad_(False)
        assert refused(_Net(block), _Net(block)) == expected


def test_a_model_made_under_inference_mode_is_refused_in_one_line(tmp_path):
    """Its parameters keep no version counter (the session's guard reads them) and cannot be changed outside that
    mode: a bare RuntimeError before (a tester's case). One line, from oneshot and from a session."""
    import llmc_fsm

    with torch.inference_mode():
        model = _llama()
    line = ("the model's parameters were made under torch.inference_mode(), which keeps them from being changed or "
            "watched outside it: load (or build) the model outside inference_mode")
    with pytest.raises(ValueError) as info:
        llmc_fsm.oneshot(model=model, dataset=torch.randint(0, VOCAB, (4, 16)), output_dir=tmp_path / "out")
    assert str(info.value) == f"model (--model): {line}"
    session = Session([MagnitudePruningModifier(sparsity=0.5)])
    with pytest.raises(ValueError) as info:
        session.initialize(model=model)
    assert str(info.value) == line and session.lifecycle == "created"
    assert list(tmp_path.iterdir()) == []
    session = Session([OutputDistillationModifier()])  # a teacher too: the session's guard reads its parameters
    with pytest.raises(ValueError) as info:
        session.initialize(model=_llama(), teacher=model)
    assert str(info.value) == line.replace("model", "teacher") and session.lifecycle == "created"
