"""The mechanisms behind the performance of issue 26, measured deterministically (no timings).

* perplexity without the ``[windows, seq_len, vocab]`` logits: every tensor the evaluation creates is recorded
  by a ``TorchDispatchMode``, so the largest one is an exact count of bytes, not a load-dependent timing;
* the dense perplexity reused from :class:`llmc_fsm.data.protocol.PerplexityCache` (said so in the report);
* the calibrated modifiers' memory: no copy of a group's weights kept through the sweep, accumulators (Hessians)
  freed as soon as their group is compressed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiny_llama
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import llmc_fsm
from llmc_fsm.data.protocol import PerplexityCache, load_text, perplexity, token_windows
from llmc_fsm.toolkit import private_pages


class _NewStorages(TorchDispatchMode):
    """Records the storage bytes of every tensor an op returns, except views of the ``known`` tensors (parameters,
    inputs). A view of an intermediate counts with its whole storage (which is alive then); freed memory that the
    allocator hands out again at the same address counts again (no deduplication by address)."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.sizes: list[tuple[int, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.known and storage.nbytes() > 0:
                    self.sizes.append((storage.nbytes(), tuple(t.shape)))
        return out

    @property
    def largest(self) -> tuple[int, tuple[int, ...]]:
        return max(self.sizes)


def _reference_ppl(logits_of, windows: torch.Tensor) -> float:
    """exp(mean NLL) from full logits, float64, one window at a time (independent of the library)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in windows:
            logp = torch.log_softmax(logits_of(row[None])[0, :-1].double(), dim=-1)
            total -= float(logp.gather(1, row[1:, None]).sum())
            count += row.numel() - 1
    return math.exp(total / count)


def _big_vocab_llama():
    """A tiny Llama whose logits dominate: vocabulary 4096, hidden 32 (a window of 32 tokens: 512 KiB of logits)."""
    return tiny_llama.llama(layers=2, hidden=32, vocab=4096, heads=4, kv_heads=2, positions=64)


def _windows(n: int = 6, length: int = 32, vocab: int = 4096) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("batch_size", "loss_chunk"), [(1, 128), (4, 7), (6, 1000)])
def test_perplexity_equals_full_logit_reference_on_tiny_llama(batch_size, loss_chunk):
    model, windows = _big_vocab_llama(), _windows()
    ref = _reference_ppl(lambda ids: model(input_ids=ids).logits, windows)
    got = perplexity(model, windows, batch_size=batch_size, loss_chunk=loss_chunk, progress=False)
    assert got == pytest.approx(ref, rel=1e-6)


def test_perplexity_never_makes_the_windows_x_seq_x_vocab_logits():
    model, windows = _big_vocab_llama(), _windows()
    vocab, chunk, batch = 4096, 16, 3
    known = [*model.parameters(), *model.buffers(), windows]
    with _NewStorages(known) as mode:
        perplexity(model, windows, batch_size=batch, loss_chunk=chunk, progress=False)
    largest, shape = mode.largest
    # at most a chunk of positions' float32 logits (the first batch's 4 checked positions: 3 x 4 < 16)
    assert largest <= chunk * vocab * 4, (largest, shape)
    assert not any(vocab in s and math.prod(s) >= windows.shape[1] * vocab for _, s in mode.sizes)


class _ScaledLogits(torch.nn.Module):
    """A causal LM whose logits are its head's output halved (as a logit scale would): not the projection."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.inner(input_ids=input_ids).logits * 0.5)


def test_perplexity_of_a_model_that_changes_its_logits_uses_them_and_the_measure_sees_them():
    model, windows = _ScaledLogits(_big_vocab_llama()), _windows()
    ref = _reference_ppl(lambda ids: model(input_ids=ids).logits, windows)
    known = [*model.parameters(), *model.buffers(), windows]
    with _NewStorages(known) as mode:
        got = perplexity(model, windows, batch_size=2, loss_chunk=16, progress=False)
    assert got == pytest.approx(ref, rel=1e-6)
    # the fallback makes [2, 32, 4096] logits: the measure above would catch them in the chunked path
    assert mode.largest[0] >= 2 * 32 * 4096 * 4


def test_perplexity_rejects_bad_loss_chunk():
    with pytest.raises(ValueError, match=r"loss_chunk must be an int >= 1, got 0"):
        perplexity(_big_vocab_llama(), _windows(), loss_chunk=0, progress=False)


class _UseCacheSpy(torch.nn.Module):
    """A tiny Llama whose forward records the ``use_cache`` it is given."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.seen = inner, []

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, use_cache: bool | None = None) -> SimpleNamespace:
        self.seen.append(use_cache)
        return self.inner(input_ids=input_ids, use_cache=use_cache)


def test_perplexity_builds_no_kv_cache():
    model = _UseCacheSpy(_big_vocab_llama())
    perplexity(model, _windows(n=3), batch_size=2, progress=False)
    assert model.seen == [False, False]


def test_perplexity_of_a_nemotron_h_whose_first_layer_caches_nothing():
    """transformers 5.25's NemotronH forward fails building a cache when layer 0 is an MoE block
    (``'DummyLayer' object has no attribute 'get_seq_length'``); the perplexity asks for no cache."""
    import tiny_families
    import transformers

    cfg = tiny_families.config("nemotron_h", layers_block_type=["moe", "mamba", "attention", "mlp"])
    assert cfg.use_cache  # the model's own default: a cache
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    windows = _windows(n=2, length=16, vocab=cfg.vocab_size)
    ref = _reference_ppl(lambda ids: model(input_ids=ids, use_cache=False).logits, windows)
    assert perplexity(model, windows, progress=False) == pytest.approx(ref, rel=1e-6)


@pytest.mark.slow
def test_perplexity_equals_full_logit_reference_on_smollm2(smollm2, shared_data):
    model, tokenizer = smollm2
    text = load_text(shared_data / "wikitext-2-raw" / "wiki.test.raw")
    windows = token_windows(tokenizer, text, num_windows=3, seq_len=128)
    ref = _reference_ppl(lambda ids: model(input_ids=ids).logits, windows)
    # the previous implementation: full float32 logits of each window, float32 cross-entropy, under inference_mode
    with torch.inference_mode():
        nll = sum(
            float(torch.nn.functional.cross_entropy(model(input_ids=row[None]).logits[0, :-1], row[1:], reduction="sum"))
            for row in windows
        )
    previous = math.exp(nll / (windows.shape[0] * (windows.shape[1] - 1)))
    assert perplexity(model, windows, batch_size=1, progress=False) == pytest.approx(previous, rel=1e-6)
    # float64 reference (no_grad) and batches of 3 (other matrix-product blocking): float rounding over 30 layers
    assert previous == pytest.approx(ref, rel=1e-4)
    assert perplexity(model, windows, batch_size=3, progress=False) == pytest.approx(ref, rel=1e-4)


# ---------------------------------------------------------------- dense perplexity reused
def test_dense_perplexity_is_reused_for_the_same_model_files_and_windows(tiny_model_dir, tmp_path, monkeypatch):
    model_dir, text = tiny_model_dir
    kw = {"num_calibration_samples": 4, "max_seq_length": 16, "eval_text": text, "num_eval_windows": 3}
    kw |= {"progress": False, "dataset": text}
    measured = []
    real = llmc_fsm.oneshot_job.phases.perplexity
    monkeypatch.setattr(llmc_fsm.oneshot_job.phases, "perplexity", lambda *a, **k: measured.append(1) or real(*a, **k))
    first = llmc_fsm.oneshot(str(model_dir), **kw).llmc_fsm_report
    assert len(measured) == 2 and "before" not in first.eval
    second = llmc_fsm.oneshot(str(model_dir), **kw).llmc_fsm_report
    assert len(measured) == 3  # after compression only
    assert second.ppl_before == first.ppl_before
    assert second.eval["before"].startswith("reused: measured ")
    assert "(before: reused: measured " in second.format_table()
    third = llmc_fsm.oneshot(str(model_dir), **(kw | {"num_eval_windows": 2})).llmc_fsm_report
    assert len(measured) == 5 and "before" not in third.eval  # other windows: measured again


def test_perplexity_cache_key_follows_files_dtype_and_windows(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"x" * 10)
    cache = PerplexityCache(tmp_path / "cache")
    windows = torch.arange(12).view(3, 4)
    key = cache.key(model_dir, "float32", windows)
    assert key == cache.key(model_dir, "float32", windows.clone())
    assert len({key, cache.key(model_dir, "bfloat16", windows), cache.key(model_dir, "float32", windows + 1)}) == 3
    cache.put(key, 12.5, model="m")
    assert cache.get(key)["ppl"] == 12.5
    (model_dir / "model.safetensors").write_bytes(b"y" * 11)  # a changed checkpoint
    assert cache.get(cache.key(model_dir, "float32", windows)) is None
    assert PerplexityCache(None).key(model_dir, "float32", windows) is None
    assert cache.key(tmp_path / "missing", "float32", windows) is None
    monkeypatch_env = {"LLMC_FSM_PERPLEXITY_CACHE": "off"}
    with pytest.MonkeyPatch.context() as m:
        for name, value in monkeypatch_env.items():
            m.setenv(name, value)
        assert PerplexityCache.default().directory is None


def test_the_perplexity_cache_follows_the_cache_root_the_converted_models_use(tmp_path, monkeypatch):
    """README: the dense perplexity is cached beside the converted model, under ``$LLMC_FSM_CACHE`` when set; a
    newcomer's run with ``LLMC_FSM_CACHE`` set still wrote into the shared ``~/.cache/llmc_fsm/perplexity``."""
    from llmc_fsm.models.known import cache_root

    monkeypatch.delenv("LLMC_FSM_PERPLEXITY_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LLMC_FSM_CACHE", str(tmp_path / "root"))
    assert PerplexityCache.default().directory == cache_root() / "perplexity" == tmp_path / "root" / "perplexity"
    monkeypatch.delenv("LLMC_FSM_CACHE")
    xdg = tmp_path / "xdg" / "llmc_fsm" / "perplexity"
    assert PerplexityCache.default().directory == cache_root() / "perplexity" == xdg
    monkeypatch.setenv("LLMC_FSM_PERPLEXITY_CACHE", str(tmp_path / "own"))
    assert PerplexityCache.default().directory == tmp_path / "own"


# ---------------------------------------------------------------- calibrated modifiers' memory
@pytest.mark.parametrize(
    "recipe",
    [
        {"stage": {"SparseGPTModifier": {"sparsity": 0.5}}},
        {"stage": {"GPTQModifier": {"scheme": {"preset": "W4A16", "weights": {"group_size": 32}}}}},
    ],
    ids=["sparsegpt", "gptq"],
)
def test_each_hessian_and_input_is_freed_as_soon_as_its_group_is_compressed(recipe):
    """Weak references to every accumulator (Hessian) and to the last calibration input: when a group starts
    compressing, the accumulators of every group compressed before it are gone, and so is the last input."""
    import weakref

    from llmc_fsm import Session
    from llmc_fsm.pipeline.sequential import run_sequential

    model = tiny_llama.llama(layers=2)
    data = torch.randint(0, 128, (6, 16), generator=torch.Generator().manual_seed(1))
    session = Session(recipe)
    modifier = session.modifiers[0]
    made, done = [], []
    new_accumulator, compress_members = modifier._new_accumulator, modifier._compress_members

    def spy_new(module):
        acc = new_accumulator(module)
        made.append(weakref.ref(acc))
        return acc

    def spy_compress(acc, members):
        alive = [ref for ref in done if ref() is not None]
        assert alive == [], f"{len(alive)} Hessians of compressed groups still alive"
        assert modifier._last_acc is None or modifier._last_acc is acc
        compress_members(acc, members)
        # nothing of the modifier's keeps the group's statistics or its last input past its compression
        assert modifier._last_acc is None and modifier._last_input is None
        assert all(a is not acc for a in modifier._acc.values())
        done.append(weakref.ref(acc))

    modifier._new_accumulator, modifier._compress_members = spy_new, spy_compress
    session.initialize(model=model, calibration_data=data)
    run_sequential(session, batch_size=3, progress=False)
    assert len(done) == 2 * 4  # 4 groups (q/k/v, o, gate/up, down) per layer
    assert [ref for ref in made if ref() is not None] == []
    assert modifier._last_input is None and modifier._acc == {}


# ---------------------------------------------------------------- the data-free path
def test_a_data_free_job_does_not_read_the_model_files_to_fingerprint_them(tiny_model_dir, tmp_path, monkeypatch):
    """The fingerprint (for --resume) of a data-free job records file sizes and times: it keeps no per-layer
    progress, so reading the whole checkpoint to hash it bought nothing. A calibrated job still hashes them."""
    from llmc_fsm.oneshot_job import resume

    model_dir, text = tiny_model_dir
    hashed = []
    real = resume._file_digest
    monkeypatch.setattr(resume, "_file_digest", lambda p: hashed.append(p.name) or real(p))
    rtn = {"quantization_stage": {"QuantizationModifier": {"scheme": "W8A8"}}}
    llmc_fsm.oneshot(str(model_dir), rtn, output_dir=tmp_path / "rtn", progress=False)
    assert hashed == []
    assert (tmp_path / "rtn" / "model.safetensors").is_file()
    llmc_fsm.oneshot(
        str(model_dir), None, dataset=text, num_calibration_samples=4, max_seq_length=16,
        output_dir=tmp_path / "sparsegpt", progress=False,
    )
    assert "model.safetensors" in hashed


class _WeightWrites(TorchDispatchMode):
    """Counts the ops that write into each given weight's storage in place (``copy_`` and other ``_`` ops)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = {w.untyped_storage().data_ptr(): n for n, w in weights.items()}
        self.writes: dict[str, int] = dict.fromkeys(weights, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.endswith("_") and args and isinstance(args[0], torch.Tensor):
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.writes[name] += 1
        return func(*args, **(kwargs or {}))


def _loaded_tiny_llama(tmp_path):
    """A tiny Llama saved and loaded back by ``from_pretrained``: its weights lie in a private map of the file."""
    from transformers import AutoModelForCausalLM

    tiny_llama.llama(layers=2, tied=False).save_pretrained(tmp_path / "tiny")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float32)


def test_rtn_takes_the_rounded_weight_without_writing_into_the_loaded_one(tmp_path):
    """RTN writes nothing into a loaded weight's storage (on a memory-mapped checkpoint every written page faults):
    the module's Parameter (the same object, so hooks and optimizers keep it) takes the rounded tensor's storage,
    and holds exactly what ``rtn_quantize`` gives for the original weight."""
    from llmc_fsm_quantization import rtn_quantize

    from llmc_fsm import Session

    model = _loaded_tiny_llama(tmp_path)
    assert not any(private_pages(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear))
    session = Session({"quantization_stage": {"QuantizationModifier": {"scheme": "W8A8"}}})
    session.initialize(model=model, calibration_data=None)
    weights = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    originals = {n: w.detach().clone() for n, w in weights.items()}
    loaded = {n: w.data for n, w in weights.items()}  # kept alive: a freed storage's address could be reused
    with _WeightWrites(loaded) as mode:
        session.calibration_start()
        session.calibration_end()
    assert mode.writes == dict.fromkeys(weights, 0)
    assert all(torch.equal(loaded[n], originals[n]) for n in weights)
    for name, weight in weights.items():
        module = model.get_submodule(name)
        assert module.weight is weight
        expected = rtn_quantize(originals[name], module.quantization_scheme.weights).weight
        assert torch.equal(module.weight.detach(), expected)
    assert all(m.quantization_status.value == "frozen" for m in (model.get_submodule(n) for n in weights))


def test_rtn_writes_into_a_weight_an_earlier_modifier_wrote(tmp_path):
    """A loaded weight that was written in place before RTN (as rotations and smoothing do) is private memory
    already: RTN writes the rounded values into it (one write, no page fault) instead of handing the Parameter a new
    storage, which would keep both copies resident."""
    from llmc_fsm_quantization import rtn_quantize

    from llmc_fsm import Session

    model = _loaded_tiny_llama(tmp_path)
    weights = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    with torch.no_grad():
        for w in weights.values():
            w.mul_(0.5)  # what a smoothing modifier does: the map's pages are copied on write
    assert all(private_pages(w) for w in weights.values())
    originals = {n: w.detach().clone() for n, w in weights.items()}
    storages = {n: w.untyped_storage().data_ptr() for n, w in weights.items()}
    session = Session({"quantization_stage": {"QuantizationModifier": {"scheme": "W8A8"}}})
    session.initialize(model=model, calibration_data=None)
    with _WeightWrites(dict(weights)) as mode:
        session.calibration_start()
        session.calibration_end()
    assert mode.writes == dict.fromkeys(weights, 1)
    for name, weight in weights.items():
        module = model.get_submodule(name)
        assert module.weight is weight and weight.untyped_storage().data_ptr() == storages[name]
        assert torch.equal(weight.detach(), rtn_quantize(originals[name], module.quantization_scheme.weights).weight)


def test_private_pages_tells_file_pages_from_private_ones(tmp_path):
    """``private_pages``: an untouched or only-read page of a private file map is not private; a written one is
    (copied on write); ordinary tensor memory is once written."""
    path = tmp_path / "pages.bin"
    path.write_bytes(bytes(4 * 4096))
    mapped = torch.from_file(str(path), shared=False, size=4096, dtype=torch.float32)
    assert not private_pages(mapped)  # not touched: not resident
    assert float(mapped.sum()) == 0.0
    assert not private_pages(mapped)  # read: the file's page
    mapped[0] = 1.0
    assert private_pages(mapped)  # written: an anonymous copy
    assert private_pages(torch.ones(4096))
    assert not private_pages(torch.empty(0))


def _resident_pages(t: torch.Tensor) -> int:
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    start, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start // page * 8)
        last = -(-(start + size) // page)
        raw = f.read((last - start // page) * 8)
    return sum(int.from_bytes(raw[i : i + 8], "little") >> 63 for i in range(0, len(raw), 8))


def test_release_file_pages_unmaps_unwritten_file_pages_and_nothing_written(tmp_path):
    """``release_file_pages``: the read pages of a private file map are unmapped and read back the file's values;
    a storage with one written (private) page is left whole; ordinary tensor memory is never released."""
    from llmc_fsm.toolkit import release_file_pages

    path = tmp_path / "pages.bin"
    values = torch.arange(4 * 4096, dtype=torch.float32)
    path.write_bytes(values.numpy().tobytes())
    mapped = torch.from_file(str(path), shared=False, size=4 * 4096, dtype=torch.float32)
    assert torch.equal(mapped, values)  # read: 16 file pages resident
    assert _resident_pages(mapped) == 16
    assert release_file_pages(mapped) == 16 * 4096
    assert _resident_pages(mapped) == 0
    assert torch.equal(mapped, values)  # mapped again from the file
    mapped[5000] = -1.0  # page 1 now private
    assert release_file_pages(mapped) == 0
    assert _resident_pages(mapped) == 16 and float(mapped[5000]) == -1.0
    assert release_file_pages(torch.ones(8192)) == 0


def test_rtn_on_a_loaded_checkpoint_unmaps_the_replaced_weights(tmp_path):
    """RTN on a model loaded by ``from_pretrained``: each replaced weight's checkpoint pages are no longer resident
    (read back, they still hold the checkpoint's values), so the loaded and the rounded copy are not both kept."""
    from llmc_fsm import Session

    model = _loaded_tiny_llama(tmp_path)
    weights = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    loaded = {n: w.data for n, w in weights.items()}
    originals = {n: w.detach().clone() for n, w in loaded.items()}  # reads every page: all resident
    assert all(_resident_pages(w) > 0 for w in loaded.values())
    session = Session({"quantization_stage": {"QuantizationModifier": {"scheme": "W8A8"}}})
    session.initialize(model=model, calibration_data=None)
    session.calibration_start()
    session.calibration_end()
    inner = {n: w for n, w in loaded.items() if w.untyped_storage().nbytes() >= 3 * 4096}  # whole pages inside
    assert inner and all(_resident_pages(w) <= 2 for w in inner.values())  # at most the two boundary pages
    assert all(torch.equal(loaded[n], originals[n]) for n in weights)


@pytest.mark.parametrize("method", [["--method", "rtn", "--scheme", "W8A8"], ["--method", "sparsegpt", "--num-samples", "4"]])
@pytest.mark.parametrize(("flags", "fixed"), [([], 0), (["--low-memory"], 1)])
def test_only_low_memory_fixes_the_heap_threshold(tiny_model_dir, tmp_path, monkeypatch, flags, fixed, method):
    """``--low-memory`` fixes glibc's memory-map threshold (flat peak); the command's default streaming does not,
    data-free or calibrated (its page faults cost SmolLM2 RTN more than a third of the compression and SparseGPT
    about 10% of its CPU time; the default gives the freed heap back after each layer instead, docs/memory.md)."""
    from llmc_fsm.cli import main

    calls = []
    monkeypatch.setattr("llmc_fsm.oneshot_job.streaming.limit_heap_growth", lambda: calls.append(1) or False)
    monkeypatch.setenv("LLMC_FSM_PERPLEXITY_CACHE", "off")
    model_dir, text = tiny_model_dir
    argv = tiny_llama.oneshot_argv(model_dir, text, tmp_path / "out", *method, *flags)
    assert main(argv) == 0
    assert len(calls) == fixed
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1  # streamed: a shard per decoder layer


def test_the_printed_per_layer_error_is_the_size_weighted_mean_the_plot_draws():
    """The CLI table's per-layer relative output error weights each module by its number of weights (as
    ``llmc-fsm report --plot`` does): 3 x 0.1 over 300 weights and 1 x 0.5 over 100 give 0.2, not 0.3."""
    from llmc_fsm.report.build import ModuleSparsity, OneshotReport

    modules = [
        ModuleSparsity(name="a", layer=0, zeros=0, numel=300, bits=4, group_size=64, rel_output_error=0.1),
        ModuleSparsity(name="b", layer=0, zeros=0, numel=100, bits=4, group_size=64, rel_output_error=0.5),
    ]
    report = OneshotReport(model="m", recipe={}, calibration={}, modules=modules, targeted=["a", "b"])
    assert report.layer_quantization() == {0: ("4b/g64", pytest.approx(0.2, rel=1e-12))}  # no label given: bits
    assert "0.2000" in report.format_table()
    lines = report.format_table().splitlines()
    total = next(i for i, line in enumerate(lines) if line.startswith("  total "))
    assert lines[total + 1] == (
        "(a quantized weight's sparsity counts the zeros it held before quantization; "
        "values that round to zero are not counted)"
    )


def test_the_command_asks_torch_for_huge_pages_unless_the_user_set_it(monkeypatch, capsys):
    """``llmc-fsm`` sets ``THP_MEM_ALLOC_ENABLE=1`` before anything else (torch reads it at its first allocation);
    a value the user set stays."""
    from llmc_fsm.cli import main

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert main(["lifecycle"]) == 0
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert main(["lifecycle"]) == 0
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
    capsys.readouterr()


def test_low_memory_does_not_ask_for_huge_pages(monkeypatch, tmp_path, tiny_model_dir):
    """``--low-memory`` maps every large tensor afresh (a 128 KiB mmap threshold): whole huge pages would be zeroed
    for each, so the command leaves torch's allocator as it is there."""
    from llmc_fsm.cli import main

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.setattr("llmc_fsm.oneshot_job.streaming.limit_heap_growth", lambda: False)
    monkeypatch.setenv("LLMC_FSM_PERPLEXITY_CACHE", "off")
    model_dir, text = tiny_model_dir
    argv = tiny_llama.oneshot_argv(model_dir, text, tmp_path / "out", "--method", "rtn", "--scheme", "W8A8")
    assert main([*argv, "--low-memory"]) == 0
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ


_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not _THP_MODE.exists() or "[madvise]" not in _THP_MODE.read_text(),
    reason="needs transparent huge pages in 'madvise' mode (/sys/kernel/mm/transparent_hugepage/enabled): with "
    "'never' there are none, with 'always' every process gets them whatever torch asks",
)
@pytest.mark.parametrize(("user", "huge"), [(None, True), ("0", False)])
def test_a_command_process_gets_huge_pages_for_its_large_tensors(user, huge):
    """In a fresh process that runs the command first, a 64 MiB tensor lies on huge pages (``AnonHugePages`` of
    ``/proc/self/smaps_rollup``); with ``THP_MEM_ALLOC_ENABLE=0`` from the user it does not."""
    script = (
        "from llmc_fsm.cli import main\n"
        "assert main(['lifecycle']) == 0\n"
        "import torch\n"
        "x = torch.ones(16 * 1024 * 1024)\n"
        "kb = [int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages:')][0]\n"
        "print(kb)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if user is not None:
        env["THP_MEM_ALLOC_ENABLE"] = user
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    huge_kib = int(out.stdout.strip().splitlines()[-1])
    assert (huge_kib >= 32 * 1024) if huge else (huge_kib == 0), huge_kib
