"""Issue 24's table, measured: every tiny family x {SparseGPT 50%, GPTQ W4A16}, ours beside llmcompressor 0.14's.

    python benchmarks/families_vs_llmcompressor.py                         # every family, both methods, both sides
    python benchmarks/families_vs_llmcompressor.py --families mixtral,llava --no-peer
    python benchmarks/families_vs_llmcompressor.py --families gpt_oss --methods gptq --merge rows.json --json rows.json
    python benchmarks/families_vs_llmcompressor.py --json rows.json --markdown table.md

Each family of ``tests/tiny_families.py`` (plus :data:`EXTRA`) is built offline (seed 0) with our transformers and
saved with ``save_pretrained`` to a temporary directory: both sides load THAT directory (same weights), each with
its own transformers (ours 5.24, the peer venv's 5.17). Both get the same recipe text (:data:`RECIPES`, the
family's output embedding and, for multimodal models, its towers / projectors in ``ignore``: :data:`TOWERS`;
for GPTQ on Jamba and Nemotron-H also the modules group size 16 does not divide: :data:`MISFIT`, named in the
table's method cell) and
the same calibration tokens (4 rows x 32 tokens, ``torch.randint(3, 128)`` seed 0, one batch). Ours runs here,
in-process: ``<class>.from_pretrained(src)``, ``llmc_fsm.oneshot(model, recipe=TEXT, dataset=tokens,
output_dir=out)``. The peer runs ``benchmarks/peer_families_llmcompressor.py`` in its venv (one process for all
families; ``oneshot(model, recipe=TEXT, dataset=DataLoader(tokens))``, then ``model.save_pretrained(out,
save_compressed=True)`` as its ``oneshot(output_dir=...)`` does).

Measured per family x method x side (functions of the peer script, shared):

* the call: ``ran``, or the exception's first line — ``refused`` when no weight had changed when it was raised,
  ``failed`` otherwise;
* which weights changed (any value differs from the loaded source), per kind: ``Linear`` (decoder Linear-like
  modules, Conv1D and FalconLinear included), ``experts`` (one matrix per expert and projection: our
  ``LinearView`` s ``<experts>.<e>.gate_proj`` ... of the fused parameters; the peer's per-expert Linear modules
  after its own ``linearize_moe``; fused expert tensors it left as they were counted per tensor), ``routers``
  (a ``gate`` / ``router`` Linear beside an ``experts`` module), ``towers`` (the family's vision / audio modules and
  projectors), and the fraction of zeros over the changed matrices;
* the saved checkpoint: safetensors keys, packed quantized ones (``weight_packed``), those under ``experts``;
* the reload, each side with its own transformers (``<class>.from_pretrained(out, output_loading_info=True)``):
  missing / unexpected / mismatched keys, logits on 2 of the rows against the in-memory compressed model's
  (``equal``: no NaN and max |difference| <= 1e-5), and how many of the source's expert tensors the reloaded model
  loaded from the checkpoint (same name and shape, not a missing key) and how many of those differ from the source.

No timing is taken (tiny models). ``OMP_NUM_THREADS=1`` is advised; the whole run takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO_ROOT / "tests"))

import torch  # noqa: E402
from peer_families_llmcompressor import (  # noqa: E402
    disk_keys,
    first_line,
    linear_weights,
    logits,
    measure_reload,
    measure_weights,
)
from tiny_families import FAMILIES, VOCAB, build  # noqa: E402

_VLM = ["re:.*vision_tower.*", "re:.*multi_modal_projector.*"]
#: family -> ignore patterns of its towers and projectors (llm-compressor's examples spell them so)
TOWERS: dict[str, list[str]] = {
    "llava": _VLM,
    "llava_pixtral": _VLM,
    "mistral3": _VLM,
    "gemma3_vlm": _VLM,
    "mllama": ["re:.*vision_model.*", "re:.*multi_modal_projector.*"],
    "qwen2_vl": ["re:.*visual.*"],
    "idefics3": ["re:.*vision_model.*", "re:.*connector.*"],
    "qwen2_audio": ["re:.*audio_tower.*", "re:.*multi_modal_projector.*"],
    "whisper": ["re:.*encoder.*"],
}

#: family -> method -> modules whose in_features the GPTQ group size 16 does not divide in the tiny config, ignored
#: by name on both sides (exactly those modules): Jamba's ``mamba.dt_proj`` (in_features ``dt_rank`` 8), Nemotron-H's
#: shared expert ``down_proj`` (in_features ``moe_shared_expert_intermediate_size`` 7688, transformers' default)
MISFIT: dict[str, dict[str, list[str]]] = {
    "jamba": {"gptq": ["re:.*mamba\\.dt_proj$"]},
    "nemotron_h": {"gptq": ["re:.*shared_experts\\.down_proj$"]},
}

RECIPES = {
    "sparsegpt": """
sparsity_stage:
  sparsity_modifiers:
    SparseGPTModifier:
      sparsity: 0.5
      targets: [Linear]
      ignore: {ignore}
""",
    "gptq": """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: {ignore}
      config_groups:
        group_0:
          targets: [Linear]
          weights: {{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 16}}
""",
    # llm-compressor's examples/quantizing_moe/mixtral_example.py: FP8 weights and static FP8 inputs, per tensor
    "fp8": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: {ignore}
      targets: [Linear]
      scheme: FP8
""",
}

ROWS, LENGTH, LOGIT_ROWS = 4, 32, 2


def _regexes(patterns: list[str]) -> list[str]:
    """``re:X`` -> ``X``; a plain name -> itself escaped (for :func:`re.fullmatch` in the measures)."""
    import re

    return [p[3:] if p.startswith("re:") else re.escape(p) for p in patterns]


def _views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our per-expert Linear views of the fused expert parameters, by full name (Conv1D is already a module)."""
    from llmc_fsm.toolkit.views import clear_weight_views, weight_views

    out = {}
    for name, module in model.named_modules():
        for suffix, view in weight_views(module).items():
            if suffix:
                out[f"{name}.{suffix}"] = view.weight.detach().clone()
        clear_weight_views(module)
    return out


def run_ours(spec: dict[str, Any], method: str, tokens: torch.Tensor) -> dict[str, Any]:
    """Our side of one family x method (see the module docs)."""
    import transformers

    import llmc_fsm

    row: dict[str, Any] = {"family": spec["family"], "method": method}
    cls = getattr(transformers, spec["cls"])
    model = cls.from_pretrained(spec["src"]).eval()
    source_experts = {n: t.detach().clone() for n, t in model.state_dict().items() if ".experts" in n}
    before = linear_weights(model, _views(model))
    module_names = {n for n, _ in model.named_modules()}
    towers = spec["towers"]
    out = Path(spec["methods"][method]["out"])
    try:
        llmc_fsm.oneshot(
            model=model,
            recipe=spec["methods"][method]["recipe"],
            dataset=tokens,
            output_dir=out,
            progress=False,
            overwrite=True,
        )
    except Exception as exc:
        traceback.print_exc()
        after = linear_weights(model, _views(model))
        changed = any(not torch.equal(after[n], t) for n, t in before.items() if n in after)
        row["error"] = first_line(exc)
        row["status"] = "failed" if changed else "refused"
        return row
    row["status"] = "ran"
    row["weights"] = measure_weights(
        before, linear_weights(model, _views(model)), set(), module_names, towers, spec["head"]
    )
    expected = logits(model, tokens[:LOGIT_ROWS])
    row["disk"] = disk_keys(out)
    row["reload"] = measure_reload(cls, out, tokens[:LOGIT_ROWS], expected, source_experts)
    return row


def prepare(families: list[str], work: Path, methods: list[str]) -> list[dict[str, Any]]:
    """Build and save each family; its spec for both sides (``methods``: keys of :data:`RECIPES`)."""
    specs = []
    for family in families:
        model = build(family)
        src = work / "src" / family
        model.save_pretrained(src)
        head_module = model.get_output_embeddings()
        head = next(n for n, m in model.named_modules() if m is head_module)
        ignore = [head, *TOWERS.get(family, [])]
        cls = FAMILIES[family][2] or "AutoModelForCausalLM"
        if cls == "AutoModelForImageTextToText":  # the same class on both sides (5.17's auto maps may differ)
            cls = type(model).__name__
        specs.append({
            "family": family,
            "cls": cls,
            "src": str(src),
            "vocab": VOCAB,
            "head": head,
            "towers": _regexes(TOWERS.get(family, [])),
            "methods": {
                m: {
                    "recipe": text.format(ignore=json.dumps([*ignore, *MISFIT.get(family, {}).get(m, [])])),
                    "out": str(work / "{side}" / family / m),
                }
                for m, text in RECIPES.items() if m in methods
            },
        })  # fmt: skip
    return specs


def _for_side(specs: list[dict[str, Any]], side: str) -> list[dict[str, Any]]:
    return [
        {**s, "methods": {m: {**v, "out": v["out"].replace("{side}", side)} for m, v in s["methods"].items()}}
        for s in specs
    ]


def _peer(specs: list[dict[str, Any]], tokens: torch.Tensor, work: Path) -> dict[str, Any]:
    from _peer import run_peer_script

    spec_file = work / "peer_spec.json"
    spec_file.write_text(
        json.dumps({"tokens": tokens.tolist(), "logit_rows": LOGIT_ROWS, "families": _for_side(specs, "peer")})
    )
    return run_peer_script(
        Path(__file__).resolve().parent / "peer_families_llmcompressor.py", ["--spec", str(spec_file)]
    )


def _cell(row: dict[str, Any] | None) -> str:
    """One table cell: the call, what changed, the reload."""
    if row is None:
        return "not run"
    if "error" in row:  # refused: a ValueError raised before any weight changed (both tools refuse so by design)
        designed = row["error"].split(":")[0].endswith(("ValueError", "ArchitectureError", "RecipeError"))
        if row.get("status") == "failed":
            status = "error after changing weights"
        else:
            status = "refused" if designed else "error, no weight changed"
        text = row["error"]
        text = text if len(text) <= 170 else f"{text[:80]} … {text[-80:]}"
        return f"{status}: `{text}`"
    for key in ("memory_logits_error", "save_error"):
        if key in row:
            return f"ran; {key.replace('_', ' ')}: `{row[key][:120]}`"
    w = row["weights"]
    parts = []
    for kind, label in (
        ("decoder", "Linear"),
        ("expert", "experts"),
        ("fused_experts", "fused expert tensors"),
        ("router", "routers"),
        ("tower", "towers"),
        ("head", "head"),
    ):
        if kind in w and (kind != "head" or w[kind]["changed"]):
            k = w[kind]
            text = f"{label} {k['changed']}/{k['total']}"
            if k["changed"] and k["changed_zero_fraction"] is not None and k["changed_zero_fraction"] >= 0.3:
                text += f" ({100 * k['changed_zero_fraction']:.0f}% 0)"
            parts.append(text)
    d = row.get("disk", {})
    if d.get("packed"):
        parts.append(f"packed {d['packed']}" + (f", experts {d['expert_packed']}" if d.get("expert_keys") else ""))
    r = row.get("reload", {})
    if "error" in r:
        reload = f"reload fails: `{r['error'][:120]}`"
    else:
        keys = []
        for k in ("missing", "unexpected", "mismatched"):
            if r.get(k):
                keys.append(f"{len(r[k])} {k} (`{r[k][0]}`...)")
        if "logits_error" in r:
            logit = f"logits fail: `{r['logits_error'][:100]}`"
        elif r.get("nan"):
            logit = "logits NaN"
        elif r.get("logits_equal"):
            logit = "logits equal"
        else:
            logit = f"logits off by {r['max_abs_diff']:.2g}"
        reload = "reload: " + ", ".join([*keys, logit]) if keys else f"reloads, {logit}"
        if r.get("expert_tensors"):
            reload += (
                f"; expert tensors loaded {r['expert_tensors_compared']}/{r['expert_tensors']}, "
                f"changed {r['expert_tensors_changed']}"
            )
    return "ran: " + ", ".join(parts) + "; " + reload


def render(rows: list[dict[str, Any]], families: list[str], peer_side: str) -> str:
    index = {(r["family"], r["method"], r["side"]): r for r in rows}
    lines = [
        f"| family | method | ours | llm-compressor ({peer_side}) |",
        "|---|---|---|---|",
    ]
    for family in families:
        for method, label in (("sparsegpt", "SparseGPT 50%"), ("gptq", "GPTQ W4A16 g16"), ("fp8", "FP8 (static inputs)")):
            if (family, method, "ours") not in index and (family, method, "peer") not in index:
                continue
            misfit = MISFIT.get(family, {}).get(method)
            if misfit:
                label += f" (+ ignore {', '.join(f'`{m}`' for m in misfit)})"
            ours = _cell(index.get((family, method, "ours")))
            peer = _cell(index.get((family, method, "peer")))
            lines.append(f"| {family} | {label} | {ours} | {peer} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", help="comma-separated (default: every family of tests/tiny_families.py)")
    parser.add_argument("--methods", default=",".join(RECIPES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--no-peer", action="store_true", help="ours only")
    parser.add_argument("--no-ours", action="store_true", help="the peer only")
    parser.add_argument("--workdir", help="keep the models here (default: a temporary directory)")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--markdown", help="write the table to this file")
    parser.add_argument(
        "--merge",
        help="rows of an earlier --json run: kept for the family x method x side not run now, and the table "
        "lists all of them (e.g. one family re-run after a change)",
    )
    args = parser.parse_args(argv)
    families = args.families.split(",") if args.families else list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    methods = args.methods.split(",")
    if any(m not in RECIPES for m in methods):
        parser.error(f"unknown methods in {methods}; known: {', '.join(RECIPES)}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        tokens = torch.randint(3, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
        specs = prepare(families, work, methods)
        rows: list[dict[str, Any]] = []
        peer_side = "not run"
        if not args.no_peer:
            result = _peer(specs, tokens, work)
            peer_side = result["side"]
            rows += [{**r, "side": "peer"} for r in result["rows"]]
        if not args.no_ours:
            for spec in _for_side(specs, "ours"):
                for method in spec["methods"]:
                    print(f"[ours] {spec['family']} {method}", file=sys.stderr, flush=True)
                    try:
                        row = run_ours(spec, method, tokens)
                    except Exception as exc:  # the row says why; the next one runs
                        traceback.print_exc()
                        row = {"family": spec["family"], "method": method, "error": "measure: " + first_line(exc)}
                    rows.append({**row, "side": "ours"})
    if args.merge:
        earlier = json.loads(Path(args.merge).read_text())
        ran = {(r["family"], r["method"], r["side"]) for r in rows}
        rows = [r for r in earlier["rows"] if (r["family"], r["method"], r["side"]) not in ran] + rows
        peer_side = earlier["peer_side"] if peer_side == "not run" else peer_side
        families = [*dict.fromkeys([*(r["family"] for r in earlier["rows"]), *families])]
    table = render(rows, families, peer_side)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"peer_side": peer_side, "rows": rows}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
