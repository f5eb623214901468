"""Fine-tune a 50%-sparse SmolLM2-135M with the Hugging Face Trainer, keeping it sparse.

Same recipe as ``finetune_sparse_distill.py`` (ConstantPruning + distillation from
the dense model + cosine learning rate), driven by
``llmc_fsm.integrations.transformers.SessionTrainer``: the trainer hands the
session its model and teacher at construction, the optimizer when it creates it,
``steps_per_epoch`` from its dataloader, initializes before the first step and
finalizes when training ends.

    python examples/trainer_sparse.py                        # prune in-process
    python examples/trainer_sparse.py --pruned out/sparse50  # from `llmc-fsm oneshot`
    python examples/trainer_sparse.py --steps 4 --seq-len 32 # CI-sized
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sparse_common import freeze_all_but_last, linear_sparsity, load_models, parser, train_windows

from llmc_fsm.integrations.transformers import SessionTrainer


class _Windows(torch.utils.data.Dataset):
    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.windows[i]
        return {"input_ids": ids, "labels": ids}


class _PrintLoss(TrainerCallback):
    def __init__(self, trainer_ref: list) -> None:
        self.trainer_ref = trainer_ref
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer_ref[0]
        distill, lr = trainer.session.modifiers[1], trainer.session.modifiers[2]
        print(
            f"step {state.global_step:3d}  student {distill.last_student_loss.item():.4f}  "
            f"kd {distill.last_distill_loss.item():.4f}  lr {lr.last_lr:.2e}  "
            f"{time.perf_counter() - self.t0:.1f}s",
            flush=True,
        )


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = f"""
    finetune:
      ConstantPruningModifier: {{}}
      OutputDistillationModifier: {{temperature: {args.temperature}, alpha: {args.alpha}}}
      LearningRateModifier: {{schedule: cosine, init_lr: {args.lr}, final_lr: {args.lr / 10}, end: 1.0}}
    """
    student, teacher, tokenizer = load_models(args)
    freeze_all_but_last(student, args.train_layers)
    dataset = _Windows(train_windows(tokenizer, args))
    sparsity_before = linear_sparsity(student)
    print(f"sparsity before: {sparsity_before:.4f}; {len(dataset)} windows x {args.seq_len} tokens", flush=True)

    ref: list = []
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            num_train_epochs=1,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum,
            learning_rate=args.lr,
            weight_decay=0.0,
            logging_steps=1,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = SessionTrainer(
            model=student,
            args=training_args,
            train_dataset=dataset,
            recipe=recipe,
            teacher=teacher,
            callbacks=[_PrintLoss(ref)],
        )
        ref.append(trainer)
        trainer.train()

    sparsity_after = linear_sparsity(student)
    held = trainer.session.modifiers[0].measured_sparsity
    print(f"final measured sparsity: {sparsity_after:.4f} (ConstantPruningModifier: {held:.4f})", flush=True)
    return {"sparsity_before": sparsity_before, "sparsity_after": sparsity_after, "steps": trainer.session.global_step}


if __name__ == "__main__":
    main()
