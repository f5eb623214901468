"""Peer side of ``benchmarks/families_vs_llmcompressor.py``: llmcompressor's ``oneshot`` on tiny saved models.

Runs INSIDE the peer venv (see ``benchmarks/_peer.py``), never in ours; the driver calls it once for all families::

    python benchmarks/_peer.py benchmarks/peer_families_llmcompressor.py --spec spec.json

``spec.json`` (written by the driver): ``tokens`` (the calibration token ids, ``[rows][length]``), ``logit_rows``
(how many of those rows the logits are compared on) and ``families``: per family its model class name, the source
directory (saved by the driver with our transformers), and per method the output directory and the recipe text
(the same YAML text ours reads). Per family and method: the model is loaded with the peer's transformers
(``<class>.from_pretrained(src)``), its mixture-of-experts modules linearized the way llmcompressor's ``oneshot``
does it anyway (``linearize_moe``; done first here so the weights can be snapshotted per expert), every weight
snapshotted, ``oneshot(model, recipe=TEXT, dataset=DataLoader(the tokens), processor=a word-level tokenizer of the
model's vocabulary)`` called, the changed weights counted (:func:`measure_weights`) and the in-memory logits
taken, then ``model.save_pretrained(out, save_compressed=True)`` (what its ``oneshot(output_dir=...)`` does after
calibration) and the output reloaded with the peer's transformers (:func:`measure_reload`). Prints ONE JSON object as
the last stdout line: ``{"side": ..., "rows": [...]}``.

The measuring functions use only torch, transformers and safetensors: the driver imports them too.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

#: a module name inside an experts container: ``...experts.3.gate_proj``, DBRX ``...experts.mlp.3.w1``
EXPERT_NAME = re.compile(r"\.experts\.(mlp\.)?\d+\.")
#: the last name component of a mixture-of-experts router kept as a Linear
ROUTER_LAST = {"gate", "router", "layer"}
ATOL = 1e-5


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _is_linear_like(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return False
    if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
        return True
    return type(module).__name__.endswith("Router")  # a mixture-of-experts router kept as its own class


def classify(name: str, module_names: set[str], towers: list[str], head: str) -> str:
    """The kind of the Linear-like weight of module ``name``: ``head`` (the output embedding), ``tower`` (a name
    matching one of the family's tower / projector regexes), ``expert`` (a module inside an experts container, or
    one of our per-expert views), ``router`` (a ``gate`` / ``router`` Linear beside an ``experts`` module; DBRX:
    ``router.layer``) or ``decoder`` (every other one)."""
    if name == head:
        return "head"
    if any(re.fullmatch(p, name) for p in towers):
        return "tower"
    if EXPERT_NAME.search(name + "."):
        return "expert"
    parent, _, last = name.rpartition(".")
    if last == "layer" and parent.endswith(".router"):
        parent, last = parent.rpartition(".")[0], "router"
    if last in ROUTER_LAST and f"{parent}.experts" in module_names:
        return "router"
    return "decoder"


def linear_weights(model: torch.nn.Module, extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every Linear-like module's weight ``[out, in]`` (Conv1D transposed) by module name, cloned; plus ``extra``."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if _is_linear_like(module):
            w = module.weight.detach()
            out[name] = (w.t() if type(module).__name__ == "Conv1D" else w).clone()
    for name, tensor in (extra or {}).items():
        out[name] = tensor.detach().clone()
    return out


def fused_expert_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Expert parameters not held by a Linear-like module (fused 3-D experts, DBRX's 2-D ``w1``/``v1``/``w2``)."""
    owners = {n for n, m in model.named_modules() if _is_linear_like(m)}
    out = {}
    for name, param in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if ".experts" in name and param.dim() >= 2 and owner not in owners:
            out[name] = param.detach().clone()
    return out


def measure_weights(
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    fused: set[str],
    module_names: set[str],
    towers: list[str],
    head: str,
) -> dict[str, Any]:
    """Per kind of weight (:func:`classify`; the names in ``fused`` are fused expert tensors, kind
    ``fused_experts``, counted per tensor): ``total`` matrices, ``changed`` (any value differs from ``before``),
    ``missing`` (gone or reshaped after the call) and the fraction of zeros over the changed ones
    (``changed_zero_fraction``)."""
    kinds: dict[str, dict[str, Any]] = {}
    for name, old in before.items():
        new = after.get(name)
        kind = "fused_experts" if name in fused else classify(name, module_names, towers, head)
        k = kinds.setdefault(kind, {"total": 0, "changed": 0, "zeros": 0, "numel": 0, "missing": 0})
        k["total"] += 1
        if new is None or new.shape != old.shape:
            k["missing"] += 1
            continue
        if not torch.equal(new, old):
            k["changed"] += 1
            k["zeros"] += int((new == 0).sum())
            k["numel"] += new.numel()
    for k in kinds.values():
        k["changed_zero_fraction"] = k.pop("zeros") / k["numel"] if k["numel"] else None
        k.pop("numel")
    return kinds


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits on ``tokens`` (text only), float32."""
    with torch.no_grad():
        if getattr(model.config, "is_encoder_decoder", False):
            return model(decoder_input_ids=tokens).logits.float()
        return model(input_ids=tokens).logits.float()


def disk_keys(out: Path) -> dict[str, int]:
    """Keys of the saved safetensors files: all, packed quantized weights, and those of them under ``experts``."""
    from safetensors import safe_open

    keys: list[str] = []
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys.extend(f.keys())
    return {
        "keys": len(keys),
        "packed": sum(k.endswith(".weight_packed") for k in keys),
        "expert_keys": sum(".experts." in k for k in keys),
        "expert_packed": sum(".experts." in k and k.endswith(".weight_packed") for k in keys),
    }


def measure_reload(
    cls: Any,
    out: Path,
    tokens: torch.Tensor,
    expected: torch.Tensor,
    source_experts: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """Reload ``out`` with ``cls.from_pretrained(out, output_loading_info=True)``: its missing / unexpected /
    mismatched keys, its logits against ``expected`` (the in-memory compressed model's), and of the source's
    expert tensors (parameters named ``...experts...``): how many the reloaded model has under the same name and
    shape, not among its missing keys (``expert_tensors_compared``; loaded from the checkpoint), and how many of
    those differ from the source (``expert_tensors_changed``)."""
    row: dict[str, Any] = {}
    try:
        reloaded, info = cls.from_pretrained(str(out), output_loading_info=True)
    except Exception as exc:
        traceback.print_exc()
        return {"error": first_line(exc)}
    reloaded.eval()
    row["missing"] = sorted(info.get("missing_keys", []))
    row["unexpected"] = sorted(info.get("unexpected_keys", []))
    row["mismatched"] = sorted(str(m[0]) if isinstance(m, tuple) else str(m) for m in info.get("mismatched_keys", []))
    try:
        got = logits(reloaded, tokens)
        row["nan"] = bool(torch.isnan(got).any())
        row["max_abs_diff"] = float((got - expected).abs().max())
        row["logits_equal"] = (not row["nan"]) and row["max_abs_diff"] <= ATOL
    except Exception as exc:
        traceback.print_exc()
        row["logits_error"] = first_line(exc)
    state = reloaded.state_dict()
    missing = set(row["missing"])
    compared = [n for n, t in source_experts.items() if n in state and state[n].shape == t.shape and n not in missing]
    row["expert_tensors"] = len(source_experts)
    row["expert_tensors_compared"] = len(compared)
    row["expert_tensors_changed"] = sum(not torch.equal(state[n].float(), source_experts[n].float()) for n in compared)
    return row


def _tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0")


def run_one(family: dict[str, Any], method: str, tokens: torch.Tensor, rows: int) -> dict[str, Any]:
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe

    spec = family["methods"][method]
    row: dict[str, Any] = {"family": family["family"], "method": method}
    cls = getattr(transformers, family["cls"])
    try:
        source = cls.from_pretrained(family["src"]).eval()
        model, info = cls.from_pretrained(family["src"], output_loading_info=True)
    except Exception as exc:
        traceback.print_exc()
        row["error"] = "load: " + first_line(exc)
        return row
    row["source_missing"] = sorted(info.get("missing_keys", []))
    model.eval()
    source_experts = {n: p.detach().clone() for n, p in source.state_dict().items() if ".experts" in n}
    try:
        linearize_moe(model)
    except Exception as exc:
        row["linearize_error"] = first_line(exc)
    fused = fused_expert_tensors(model)
    before = linear_weights(model, fused)
    module_names = {n for n, _ in model.named_modules()}
    data = [{"input_ids": r, "attention_mask": torch.ones_like(r)} for r in tokens]
    loader = torch.utils.data.DataLoader(data, batch_size=len(data))
    out = Path(spec["out"])
    processor = _tokenizer(family["vocab"])
    try:
        model = oneshot(model=model, recipe=spec["recipe"], dataset=loader, processor=processor)
    except Exception as exc:
        traceback.print_exc()
        row["error"] = first_line(exc)
        after = linear_weights(model, fused_expert_tensors(model))
        changed = any(n in after and not torch.equal(after[n], t) for n, t in before.items())
        row["status"] = "failed" if changed else "refused"
        return row
    after = linear_weights(model, fused_expert_tensors(model))
    row["weights"] = measure_weights(before, after, set(fused), module_names, family["towers"], family["head"])
    model.eval()
    try:
        expected = logits(model, tokens[:rows])
    except Exception as exc:
        traceback.print_exc()
        row["memory_logits_error"] = first_line(exc)
        return row
    try:  # what oneshot(output_dir=...) does after calibration (its post_process), after the measures above:
        model.save_pretrained(str(out), save_compressed=True)  # compressing may replace the weights in memory
        processor.save_pretrained(str(out))
    except Exception as exc:
        traceback.print_exc()
        row["save_error"] = first_line(exc)
        return row
    row["disk"] = disk_keys(out)
    row["reload"] = measure_reload(cls, out, tokens[:rows], expected, source_experts)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    import llmcompressor
    import transformers

    torch.manual_seed(0)
    tokens = torch.tensor(spec["tokens"], dtype=torch.long)
    rows = []
    for family in spec["families"]:
        for method in family["methods"]:
            print(f"[peer-families] {family['family']} {method}", file=sys.stderr, flush=True)
            try:
                rows.append(run_one(family, method, tokens, spec["logit_rows"]))
            except Exception as exc:  # the row says why; the next one runs
                traceback.print_exc()
                rows.append({"family": family["family"], "method": method, "error": "measure: " + first_line(exc)})
    side = f"llmcompressor {llmcompressor.__version__}, transformers {transformers.__version__}, torch {torch.__version__}"
    print(json.dumps({"side": side, "rows": rows}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
