"""Tiny random Llama models for tests (no network): in memory, or as a model directory for CLI tests.

:func:`llama` builds a ``LlamaForCausalLM`` with seeded random weights. :func:`build` saves one
(4 decoder layers, hidden size 64) with ``save_pretrained``, next to a whitespace word-level
tokenizer trained (``tokenizers``) on the calibration text itself. Everything is deterministic.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

NUM_LAYERS = 4


#: A Llama decoder layer's Linears (names relative to the layer) by group (called on the same input), in call order.
GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
#: The same Linears, flat, in call order.
LINEARS = tuple(name for group in GROUPS for name in group)


def calibration_text(num_words: int = 6000, seed: int = 0) -> str:
    """Deterministic word salad over 150 made-up words, 12 words a line."""
    rng = random.Random(seed)
    vocab = [f"w{i:03d}" for i in range(150)]
    words = [rng.choice(vocab) for _ in range(num_words)]
    return "\n".join(" ".join(words[i : i + 12]) for i in range(0, num_words, 12)) + "\n"


def llama(
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    intermediate: int | None = None,
    vocab: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    positions: int = 64,
    tied: bool = True,
) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` in eval mode, weights drawn after ``torch.manual_seed(seed)`` (fp32, CPU).

    ``layers`` decoder layers of width ``hidden``, MLP width ``intermediate`` (default ``2 * hidden``),
    ``heads`` attention and ``kv_heads`` key/value heads, ``positions`` = ``max_position_embeddings``
    (transformers' default is 2048), ``tied``: ``lm_head`` shares the embedding. The same arguments give
    bit-identical weights.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden if intermediate is None else intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def word_tokenizer(text: str, vocab_size: int = 128) -> "PreTrainedTokenizerFast":
    """A word-level tokenizer (whitespace split, ``[UNK]``) trained on ``text``, at most ``vocab_size`` words: ids that
    fit the tiny models' vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"], vocab_size=vocab_size)
    words.train_from_iterator(text.splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")


#: the ways ``llmc_fsm.oneshot`` runs a job: a model given in memory, a directory (streamed when the job allows it,
#: else loaded; the command's default) and ``low_memory``.
PATHS = ("memory", "streamed", "low_memory")


def compress_on_every_path(
    root: Path, recipe: dict, tokenizer: Any, dtype: str | None = None, paths: tuple[str, ...] = PATHS
) -> dict[str, tuple[Any, dict, dict]]:
    """``llmc_fsm.oneshot`` of the model directory ``root/src`` with ``recipe`` (calibration and evaluation on
    ``root/cal.txt``: 8 and 4 windows of 32 tokens) in memory (loaded with transformers, ``tokenizer`` given),
    streamed from the directory (the default) and with ``low_memory``, each to ``root/<path>``; ``dtype`` (e.g.
    ``"bfloat16"``): the model loaded in it on every path; ``paths``: some of them. Returns ``{path: (the model
    oneshot returned, the saved tensors, report.json's perplexity)}``."""
    import json

    import transformers
    from safetensors.torch import load_file

    import llmc_fsm

    out = {}
    for path in paths:
        given = None
        if path == "memory":
            given = transformers.AutoModelForCausalLM.from_pretrained(root / "src", dtype=dtype or "float32")
        model = llmc_fsm.oneshot(
            model=given if given is not None else str(root / "src"), tokenizer=tokenizer if given else None,
            **({"dtype": dtype} if dtype is not None and given is None else {}),
            recipe=recipe, dataset=str(root / "cal.txt"), max_seq_length=32, num_calibration_samples=8,
            eval_text=str(root / "cal.txt"), num_eval_windows=4, output_dir=root / path, progress=False,
            low_memory=path == "low_memory",
        )  # fmt: skip
        tensors = {k: v for f in (root / path).glob("*.safetensors") for k, v in load_file(f).items()}
        out[path] = (model, tensors, json.loads((root / path / "report.json").read_text())["perplexity"])
    return out


def build(directory: Path, text: str) -> Path:
    """Write a tiny Llama with a word-level tokenizer trained on ``text`` to ``directory``; return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(text.splitlines(), trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    llama(vocab=tok.get_vocab_size(), layers=NUM_LAYERS, positions=128).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_with_text(root: Path) -> tuple[Path, Path]:
    """Write :func:`calibration_text` to ``root/cal.txt`` and :func:`build` on it to ``root/model``.

    Returns ``(model directory, calibration text file)``.
    """
    text = calibration_text()
    (root / "cal.txt").write_text(text, encoding="utf-8")
    return build(root / "model", text), root / "cal.txt"


def oneshot_argv(model_dir: Path, text: Path, out: Path, *extra: str) -> list[str]:
    """argv of ``llmc-fsm oneshot`` on ``model_dir`` calibrated on ``text`` (32-token windows) into ``out``."""
    options = ["--seq-len", "32", "--no-progress", "--output", str(out)]
    return ["oneshot", "--model", str(model_dir), "--dataset", str(text), *options, *extra]


#: Runs ``llmc-fsm`` with argv. ``LLMC_FSM_TEST_SIGNAL`` = ``layer:K:SIGNAL`` sends the process SIGNAL right
#: after decoder layer K of the first pass is saved to the work directory; ``load:SIGNAL`` / ``save:SIGNAL``
#: when the model starts loading / the output starts being written. SIGINT acts as Ctrl-C in a terminal even where
#: this process was started with SIGINT ignored (a background job of a shell without job control, nohup: Python
#: then installs no KeyboardInterrupt handler and the signal would be lost). A run that never reached the point
#: exits 97 saying so, instead of finishing as if nothing had been asked.
CLI_WITH_SIGNAL = """
import os, signal, sys
spec = os.environ.get("LLMC_FSM_TEST_SIGNAL")
sent = []
if spec:
    where, *rest = spec.split(":")
    sig_name, _, twice = rest[-1].partition("x")  # "SIGINTx2": a second one 2 ms later, during the clean-up
    if sig_name == "SIGINT":
        signal.signal(signal.SIGINT, signal.default_int_handler)
    def send():
        sent.append(rest[-1])
        if twice:
            import threading, time
            threading.Thread(target=lambda: (time.sleep(0.002), os.kill(os.getpid(), getattr(signal, sig_name))),
                             daemon=True).start()
        os.kill(os.getpid(), getattr(signal, sig_name))
    if where == "layer":
        import llmc_fsm.oneshot_job.resume as module
        original = module.LayerProgress.save
        def save(self, index, layer):
            original(self, index, layer)
            if index == int(rest[0]) and self.directory.name == "pass-0":
                send()
        module.LayerProgress.save = save
    else:
        import llmc_fsm.oneshot_job.phases as phases, llmc_fsm.output.save as output
        module, name = (phases, "load") if where == "load" else (output, "save_model")
        original = getattr(module, name)
        def hooked(*args, **kwargs):
            send()
            return original(*args, **kwargs)
        setattr(module, name, hooked)
from llmc_fsm.cli import main
status = main(sys.argv[1:])
if spec and not sent:
    print(f"LLMC_FSM_TEST_SIGNAL={spec}: the run never reached that point (exit status {status})", file=sys.stderr)
    sys.exit(97)
sys.exit(status)
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
