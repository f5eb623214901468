"""Fine-tune a 50%-sparse SmolLM2-135M in a plain PyTorch loop, keeping it sparse.

Recipe: ConstantPruningModifier (the zeros stay zero) + OutputDistillationModifier
(from the dense model) + LearningRateModifier (cosine), driven by a Session
embedded as documented in ``llmc_fsm.integrations.torch``.

    python examples/finetune_sparse_distill.py                      # prune in-process
    python examples/finetune_sparse_distill.py --pruned out/sparse50   # from `llmc-fsm oneshot`
    python examples/finetune_sparse_distill.py --steps 4 --seq-len 32  # CI-sized
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sparse_common import freeze_all_but_last, linear_sparsity, load_models, parser, train_windows

from llmc_fsm import Session
from llmc_fsm.integrations.torch import initialize, is_step, optimizer_step, steps_per_epoch


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    recipe = f"""
    finetune:
      ConstantPruningModifier: {{}}
      OutputDistillationModifier: {{temperature: {args.temperature}, alpha: {args.alpha}}}
      LearningRateModifier: {{schedule: cosine, init_lr: {args.lr}, final_lr: {args.lr / 10}, end: 1.0}}
    """
    session = Session(recipe)  # parsed and validated before any model is loaded

    student, teacher, tokenizer = load_models(args)
    session.update_state(model=student, teacher=teacher)  # where the models are born

    windows = train_windows(tokenizer, args)
    loader = torch.utils.data.DataLoader(windows, batch_size=args.batch_size, shuffle=False)
    params = freeze_all_but_last(student, args.train_layers)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    session.update_state(optimizer=optimizer, steps_per_epoch=steps_per_epoch(loader, args.grad_accum))

    initialize(session)  # every modifier initialized once; missing state would be reported here
    sparsity_before = linear_sparsity(student)
    print(f"sparsity before: {sparsity_before:.4f}; {len(loader)} batches x {args.seq_len} tokens", flush=True)

    student.train()
    distill, lr_mod = session.modifiers[1], session.modifiers[2]
    t0 = time.perf_counter()
    for i, ids in enumerate(loader):
        session.batch_start(batch=ids)
        out = student(input_ids=ids, labels=ids)
        loss = session.loss_calculated(out.loss)  # distillation replaces the loss
        (loss / args.grad_accum).backward()
        if is_step(i, len(loader), args.grad_accum):
            optimizer_step(session, optimizer)  # masks re-applied at optim_post_step
            print(
                f"step {session.global_step:3d}  loss {loss.item():.4f}  "
                f"(student {distill.last_student_loss.item():.4f}, kd {distill.last_distill_loss.item():.4f})  "
                f"lr {lr_mod.last_lr:.2e}  {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
        session.batch_end()
    session.finalize()

    sparsity_after = linear_sparsity(student)
    held = session.modifiers[0].measured_sparsity
    print(f"final measured sparsity: {sparsity_after:.4f} (ConstantPruningModifier: {held:.4f})", flush=True)
    return {"sparsity_before": sparsity_before, "sparsity_after": sparsity_after, "steps": session.global_step}


if __name__ == "__main__":
    main()
