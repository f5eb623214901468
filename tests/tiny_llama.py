"""A tiny Llama model directory with its own tokenizer and a calibration text, for CLI tests (no network).

The tokenizer is a whitespace word-level tokenizer trained (``tokenizers``) on the
text itself; the model is ``LlamaForCausalLM`` built from a ``LlamaConfig``
(4 decoder layers, hidden size 64) with seeded random weights, saved with
``save_pretrained``. Everything is deterministic.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch

NUM_LAYERS = 4


def calibration_text(num_words: int = 6000, seed: int = 0) -> str:
    """Deterministic word salad over 150 made-up words, 12 words a line."""
    rng = random.Random(seed)
    vocab = [f"w{i:03d}" for i in range(150)]
    words = [rng.choice(vocab) for _ in range(num_words)]
    return "\n".join(" ".join(words[i : i + 12]) for i in range(0, num_words, 12)) + "\n"


def build(directory: Path, text: str) -> Path:
    """Write a tiny Llama with a word-level tokenizer trained on ``text`` to ``directory``; return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(text.splitlines(), trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


#: Runs ``llmc-fsm`` with argv. ``LLMC_FSM_TEST_SIGNAL`` = ``layer:K:SIGNAL`` sends the process SIGNAL right
#: after decoder layer K of the first pass is saved to the work directory; ``load:SIGNAL`` / ``save:SIGNAL``
#: when the model starts loading / the output starts being written.
CLI_WITH_SIGNAL = """
import os, signal, sys
spec = os.environ.get("LLMC_FSM_TEST_SIGNAL")
if spec:
    where, *rest = spec.split(":")
    def send():
        os.kill(os.getpid(), getattr(signal, rest[-1]))
    if where == "layer":
        import llmc_fsm.resume as module
        original = module.LayerProgress.save
        def save(self, index, layer):
            original(self, index, layer)
            if index == int(rest[0]) and self.directory.name == "pass-0":
                send()
        module.LayerProgress.save = save
    else:
        import llmc_fsm.oneshot_phases as phases, llmc_fsm.output as output
        module, name = (phases, "load") if where == "load" else (output, "save_model")
        original = getattr(module, name)
        def hooked(*args, **kwargs):
            send()
            return original(*args, **kwargs)
        setattr(module, name, hooked)
from llmc_fsm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_cli(args: list[str], *, signal_at: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``llmc-fsm ARGS`` in a fresh process (1 thread, so every run computes the same bits).

    ``signal_at``: see :data:`CLI_WITH_SIGNAL` (e.g. ``"layer:1:SIGKILL"``, ``"save:SIGTERM"``).
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("LLMC_FSM_TEST_SIGNAL", None)
    if signal_at is not None:
        env["LLMC_FSM_TEST_SIGNAL"] = signal_at
    return subprocess.run(
        [sys.executable, "-c", CLI_WITH_SIGNAL, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
        check=False,
    )
