"""Issues 22 and 23 measured: llm-compressor recipes run by ours and by llmcompressor==0.14.0.1, one command.

    python benchmarks/recipes_vs_llmcompressor.py                      # every job, both sides (peer only when quiet)
    python benchmarks/recipes_vs_llmcompressor.py --jobs awq,sq-gptq --no-peer
    python benchmarks/recipes_vs_llmcompressor.py --calib-samples 2 --eval-windows 1 --jobs fp8-static --force-peer
    python benchmarks/recipes_vs_llmcompressor.py --json out.json --write-docs

Each job is a recipe written the way llm-compressor users write it (its examples' modifiers and arguments), and
the SAME YAML text goes to both sides: ours reads it with ``llmc_fsm.oneshot(model=..., recipe=TEXT)``, the peer
with ``llmcompressor.oneshot(model=..., recipe=TEXT)`` (``benchmarks/peer_recipe_llmcompressor.py`` in the peer
venv, through ``benchmarks/_peer.py``). Jobs (:data:`JOBS`):

* ``nvfp4a16``, ``mxfp4a16`` — ``QuantizationModifier`` scheme ``NVFP4A16`` / ``MXFP4A16``, data-free; run on the
  model loaded in bfloat16 on both sides (ours refuses fp4 formats on a float32 model: its checkpoint does not
  reload into a runnable float32 model on CPU — docs/quantization.md);
* ``nvfp4`` — ``QuantizationModifier`` scheme ``NVFP4`` (W4A4: NVFP4 weights, fp4 inputs with per-group scales
  computed at run time under an input global scale calibrated on the calibration data), bfloat16 as above; the
  perplexity of both sides is taken on the float32 copy (``_measure.for_eval``), inputs still quantized;
* ``fp8-static`` — ``QuantizationModifier`` scheme ``FP8`` (fp8 per-tensor weights, static per-tensor input scales
  observed on the calibration data);
* ``fp8-block`` — FP8 block weights with dynamic fp8 per-group inputs. The preset ``FP8_BLOCK`` uses blocks of
  128 x 128 and input groups of 128, and no SmolLM2 Linear has both widths a multiple of 128 (576, 192, 1536), so
  the recipe spells the same scheme out in ``config_groups`` with 64 x 64 blocks and input groups of 64;
* ``w4a16-kv`` — ``GPTQModifier`` W4A16 group 64 plus ``kv_cache_scheme`` fp8 per tensor (static);
* ``awq`` — ``AWQModifier`` then ``QuantizationModifier`` W4A16 group 64 in one stage (llm-compressor's current
  form: AWQ smooths, the quantization modifier carries the scheme). llmcompressor 0.14's AWQ pins its cached
  inputs in memory, which raises on a torch without an accelerator; the peer script skips that pinning on such a
  machine (it changes no value) and records it in the row (``cpu_shims``);
* ``sq-gptq`` — ``SmoothQuantModifier`` ``smoothing_strength: 0.8`` then ``GPTQModifier`` scheme ``W8A8``
  (llm-compressor's int8 example);
* ``autoround`` — ``AutoRoundModifier`` W4A16 group 64, ``iters`` = ``--autoround-iters`` (200, llm-compressor's
  default; each iteration is a forward and backward pass of one decoder layer on a batch of 8 windows, for every
  layer, so this job dominates a full run: the issue asks for the fewest iterations that beat GPTQ, i.e. several
  runs with ``--jobs autoround --autoround-iters N``); the peer goes through the ``auto-round`` package (0.15.1 in
  the peer venv);
* ``autoround-nvfp4`` — ``AutoRoundModifier`` scheme ``NVFP4A16``, ``iters`` as above, bfloat16 (as ``nvfp4a16``);
  with ``--autoround-iters 0`` both sides run auto-round's optimized round-to-nearest (its range search);
* ``autoround-mxfp4`` — the same with ``MXFP4A16``;
* ``spinquant`` — ``SpinQuantModifier`` ``rotations: [R1, R2]``, ``transform_type: hadamard``, then
  ``QuantizationModifier`` W4A16 group 64 (RTN; llm-compressor's spinquant example), with
  ``transform_block_size: 64``: llm-compressor 0.14 builds the deterministic ``hadamard`` only for powers of two
  (``ValueError: Cannot construct deterministic hadamard of size != 2^n`` for SmolLM2's 576), so R1 is
  block-diagonal, 9 Sylvester blocks of 64 — the same matrix on both sides (ours alone would also take the full
  576 = 36 x 16 matrix without a block size).

``<job>-cli`` (e.g. ``sq-gptq-cli``): the same recipe text through the command a user runs, ``llmc-fsm oneshot
--recipe FILE --dataset wiki.test.raw --output OUT`` (its defaults: 32 x 256 calibration tokens from the text's
tail, the model's own dtype or ``--dtype bfloat16`` for a bfloat16 job), called in this fresh process. That is
the command's default path: it streams one decoder layer at a time when the job allows it (it says which on its
log). Its row is compared with the peer's row of ``<job>`` (which runs once per job in a run); its ``start ->
saved`` is the process's start to the command's return (the save included), its perplexity is the reloaded
checkpoint's (the streamed model is not kept in memory).

Every W4 group-64 scheme is spelled out as one ``config_groups`` group (symmetric int4, ``targets: [Linear]``),
``ignore: [lm_head]``, so nothing depends on either side's preset overrides or defaults.

Protocol: SmolLM2-135M-Instruct, the fp32 ``smollm2-135m`` directory of :mod:`llmc_fsm.models.known` (the one
``quantize_vs_llmcompressor.py`` and ``jobs_vs_llmcompressor.py`` use), loaded with
``AutoModelForCausalLM.from_pretrained(dir, dtype=...)`` inside the timed process; calibration ``--calib-samples``
(32) x 256 tokens from the TAIL of ``wiki.test.raw``, evaluation ``--eval-windows`` (40) x 256 from its HEAD
(``llmc_fsm/data/protocol.py`` on both sides). Each side runs in a fresh process. Per run: ``call s`` = the
``oneshot`` call, ``process s`` = the whole process (imports, load, evaluation, save and reload included),
``CPU s`` = user + system time of that process, ``peak RSS`` = ``VmHWM`` right after the call, perplexity in
memory, and perplexity after ``save`` -> ``AutoModelForCausalLM.from_pretrained`` (the row says why when the save
or reload failed). A side whose call fails gets an error row (its exception's first line) and the next job runs.
The 1-minute load average is recorded before and after each run; the peer runs only when it is below 1.5
(``--force-peer`` overrides). Ratios are ours / llmcompressor, same run.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import for_eval, loadavg, status_kib  # noqa: E402
from jobs_vs_llmcompressor import QUIET, _fmt  # noqa: E402
from quantize_vs_llmcompressor import DATA, write_docs  # noqa: E402

SECTION = "## llm-compressor recipes vs llmcompressor (issues 22, 23)"
SEQ_LEN = 256

_W4G64 = """config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 64}"""

#: job -> recipe text (``{w4g64}`` and ``{iters}`` filled in), whether it calibrates, model dtype.
JOBS: dict[str, dict[str, Any]] = {
    "nvfp4a16": {"data": False, "dtype": "bfloat16", "recipe": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: [Linear]
      scheme: NVFP4A16
      ignore: [lm_head]
"""},
    "nvfp4": {"data": True, "dtype": "bfloat16", "recipe": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: [Linear]
      scheme: NVFP4
      ignore: [lm_head]
"""},
    "mxfp4a16": {"data": False, "dtype": "bfloat16", "recipe": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: [Linear]
      scheme: MXFP4A16
      ignore: [lm_head]
"""},
    "fp8-static": {"data": True, "dtype": "float32", "recipe": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: [Linear]
      scheme: FP8
      ignore: [lm_head]
"""},
    "fp8-block": {"data": False, "dtype": "float32", "recipe": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 8, type: float, symmetric: true, dynamic: false, strategy: block,
                    block_structure: [64, 64]}
          input_activations: {num_bits: 8, type: float, symmetric: true, dynamic: true, strategy: group,
                              group_size: 64}
"""},
    "w4a16-kv": {"data": True, "dtype": "float32", "recipe": """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: [lm_head]
      {w4g64}
      kv_cache_scheme: {num_bits: 8, type: float, symmetric: true, dynamic: false, strategy: tensor}
"""},
    "awq": {"data": True, "dtype": "float32", "recipe": """
quant_stage:
  quant_modifiers:
    AWQModifier:
      duo_scaling: true
    QuantizationModifier:
      ignore: [lm_head]
      {w4g64}
"""},
    "sq-gptq": {"data": True, "dtype": "float32", "recipe": """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
    GPTQModifier:
      targets: [Linear]
      scheme: W8A8
      ignore: [lm_head]
"""},
    "autoround": {"data": True, "dtype": "float32", "recipe": """
quant_stage:
  quant_modifiers:
    AutoRoundModifier:
      iters: {iters}
      ignore: [lm_head]
      {w4g64}
"""},
    "autoround-nvfp4": {"data": True, "dtype": "bfloat16", "recipe": """
quant_stage:
  quant_modifiers:
    AutoRoundModifier:
      iters: {iters}
      ignore: [lm_head]
      scheme: NVFP4A16
"""},
    "autoround-mxfp4": {"data": True, "dtype": "bfloat16", "recipe": """
quant_stage:
  quant_modifiers:
    AutoRoundModifier:
      iters: {iters}
      ignore: [lm_head]
      scheme: MXFP4A16
"""},
    "spinquant": {"data": True, "dtype": "float32", "recipe": """
quant_stage:
  quant_modifiers:
    SpinQuantModifier:
      rotations: [R1, R2]
      transform_type: hadamard
      transform_block_size: 64
    QuantizationModifier:
      ignore: [lm_head]
      {w4g64}
"""},
}


def recipe_text(job: str, iters: int) -> str:
    """The YAML recipe both sides run for ``job`` (``iters``: AutoRound's steps per decoder layer)."""
    return JOBS[job]["recipe"].replace("{w4g64}", _W4G64).replace("{iters}", str(iters)).lstrip()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def base_job(job: str) -> str:
    """``sq-gptq-cli`` -> ``sq-gptq``: the recipe (and the peer row) a ``-cli`` job runs."""
    return job.removesuffix("-cli")


def cli_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Ours through the command, in this fresh process: ``llmc-fsm oneshot --recipe`` (the default path), then the
    saved checkpoint reloaded and evaluated."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmc_fsm.cli.main import main as cli_main
    from llmc_fsm.data.protocol import load_text, perplexity, token_windows

    job = JOBS[base_job(args.worker)]
    row: dict[str, Any] = {"side": "llmc-fsm", "path": "llmc-fsm oneshot (default path)"}
    with tempfile.TemporaryDirectory() as tmp:
        recipe, out = Path(tmp) / "recipe.yaml", Path(tmp) / "out"
        recipe.write_text(recipe_text(base_job(args.worker), args.autoround_iters), encoding="utf-8")
        argv = ["oneshot", "--model", args.model_dir, "--recipe", str(recipe), "--output", str(out), "--no-progress",
                "--num-samples", str(args.calib_samples), "--seq-len", str(SEQ_LEN)]
        if job["data"]:
            argv += ["--dataset", str(DATA)]
        if job["dtype"] != "float32":
            argv += ["--dtype", job["dtype"]]
        t0 = time.perf_counter()
        status = cli_main(argv)
        if status:
            row["error"] = f"llmc-fsm oneshot exited with {status} (its stderr is above)"
            return row
        row["call_s"] = time.perf_counter() - t0
        row["to_saved_s"] = time.perf_counter() - T_START
        row["peak_rss_bytes"] = status_kib("VmHWM") * 1024
        row["weights_on_disk_bytes"] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        if args.eval_windows and JOBS[base_job(args.worker)]["dtype"] == "float32":  # as worker(): bf16 not reloaded
            tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
            evalw = token_windows(tokenizer, load_text(DATA), num_windows=args.eval_windows, seq_len=SEQ_LEN)
            reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
            row["ppl_reloaded"] = perplexity(for_eval(reloaded), evalw, progress=False)
    row["torch_threads"] = torch.get_num_threads()
    return row


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Ours, in this fresh process: load, ``oneshot`` (timed), perplexity, save, reload, perplexity."""
    if args.worker.endswith("-cli"):
        return cli_worker(args)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llmc_fsm
    from llmc_fsm.data.protocol import load_text, perplexity, token_windows
    from llmc_fsm.output.save import save_model

    job = JOBS[args.worker]
    row: dict[str, Any] = {"side": "llmc-fsm"}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, job["dtype"])).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    text = load_text(DATA)
    # Ours skips the calibration pass of a data-free stage even when given data, so the windows always go in.
    calib = token_windows(tokenizer, text, num_windows=args.calib_samples, seq_len=SEQ_LEN, from_end=True)
    t0 = time.perf_counter()
    try:
        llmc_fsm.oneshot(model=model, recipe=recipe_text(args.worker, args.autoround_iters), dataset=calib,
                         num_calibration_samples=args.calib_samples, max_seq_length=SEQ_LEN, progress=False)
    except Exception as exc:  # the row says why; the next job still runs
        row["error"] = _first_line(exc)
        return row
    row["call_s"] = time.perf_counter() - t0
    row["call_end_s"] = time.perf_counter() - T_START
    row["peak_rss_bytes"] = status_kib("VmHWM") * 1024
    evalw = token_windows(tokenizer, text, num_windows=args.eval_windows, seq_len=SEQ_LEN) \
        if args.eval_windows else None
    if evalw is not None:
        row["ppl"] = perplexity(for_eval(model), evalw, progress=False)
    probe = calib[:1]
    with torch.no_grad():
        logits = model(probe).logits
    with tempfile.TemporaryDirectory() as out:
        try:
            t_save = time.perf_counter()
            save_model(model, Path(out))
            row["save_s"] = time.perf_counter() - t_save
            row["weights_on_disk_bytes"] = sum(p.stat().st_size for p in Path(out).glob("*.safetensors"))
            del model
            reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
            if "kv_cache_scheme" in recipe_text(args.worker, args.autoround_iters):
                # transformers 5.24 ignores the saved k_scale / v_scale (docs/quantization.md): put them back
                from llmc_fsm_quantization import load_kv_cache_scales

                load_kv_cache_scales(reloaded, Path(out))
                row["reload_note"] = "k/v scales put back by load_kv_cache_scales"
            with torch.no_grad():
                row["reload_max_abs_logit_diff"] = float((reloaded(probe).logits - logits).abs().max())
            if evalw is not None and job["dtype"] == "float32":
                row["ppl_reloaded"] = perplexity(reloaded, evalw, progress=False)
        except Exception as exc:  # reported in the row
            row["reload_error"] = _first_line(exc)
    row["torch_threads"] = torch.get_num_threads()
    return row


def _ours(job: str, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "TQDM_DISABLE": "1", "LLMC_FSM_PERPLEXITY_CACHE": "off"}
    cmd = [sys.executable, __file__, "--worker", job, "--model-dir", model_dir, "--eval-windows",
           str(args.eval_windows), "--calib-samples", str(args.calib_samples),
           "--autoround-iters", str(args.autoround_iters)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"side": "llmc-fsm", "error": f"worker exited with {proc.returncode} (its stderr is above)"}
    row = json.loads(lines[-1])
    row["launch_s"] = time.perf_counter() - t0
    return row


def _peer(job: str, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    from _peer import run_peer_script

    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "recipe.yaml"
        recipe.write_text(recipe_text(job, args.autoround_iters), encoding="utf-8")
        cli = ["--model", model_dir, "--data", str(DATA), "--recipe-file", str(recipe), "--out", str(Path(tmp) / "out"),
               "--dtype", JOBS[job]["dtype"], "--calib-samples", str(args.calib_samples),
               "--eval-windows", str(args.eval_windows), *(["--with-data"] if JOBS[job]["data"] else [])]
        t0 = time.perf_counter()
        try:
            row = run_peer_script(Path(__file__).parent / "peer_recipe_llmcompressor.py", cli)
        except RuntimeError as exc:
            return {"side": "llmcompressor", "error": _first_line(exc)}
        row["launch_s"] = time.perf_counter() - t0
    return row


def _to_saved(r: dict[str, Any]) -> float | None:
    """Seconds from the process's start to the checkpoint written, evaluation excluded: imports, load, tokenizer,
    calibration windows and the ``oneshot`` call (``call_end_s``) plus the save (``save_s``); a ``-cli`` row's
    process start to the command's return."""
    if r.get("to_saved_s") is not None:
        return r["to_saved_s"]
    if r.get("call_end_s") is None or r.get("save_s") is None:
        return None
    return r["call_end_s"] + r["save_s"]


def _reloaded_cell(r: dict[str, Any]) -> str:
    """The reloaded perplexity (float32 jobs) and the largest |logit| difference between the reloaded and the
    in-memory model on one calibration window (every job; a bfloat16 model is compared in bfloat16)."""
    if "reload_error" in r:
        return "not reloaded: " + r["reload_error"].replace("|", "\\|")
    diff = r.get("reload_max_abs_logit_diff")
    cell = _fmt(r.get("ppl_reloaded"), ".2f") if r.get("ppl_reloaded") is not None else "not measured (bf16)"
    return cell if diff is None else f"{cell}; max abs logit diff {diff:.3g}"


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        SECTION, "",
        f"Measured {time.strftime('%Y-%m-%d')} by `python benchmarks/recipes_vs_llmcompressor.py` (calibration "
        f"{args.calib_samples} x {SEQ_LEN} tokens from the tail of wiki.test.raw, perplexity on {args.eval_windows} "
        f"x {SEQ_LEN} from its head, AutoRound iters {args.autoround_iters}); each job's recipe text is in the "
        "script (`JOBS`), the same for both sides. `call s`: the `oneshot` call; `process s`, `CPU s`: the whole "
        "fresh process (evaluation included); `start -> saved s`: from the process's start to the checkpoint "
        "written, evaluation excluded (imports, load, calibration windows, the call, the save); peak RSS: `VmHWM` after the call; reloaded: the saved checkpoint reloaded with "
        "transformers: its perplexity (float32 jobs; a bfloat16 job's in-memory perplexity is taken on a float32 "
        "copy of its exact values, bf16 products being ~20x slower on this CPU) and the largest |logit| difference "
        "to the in-memory model on one calibration window.", "",
        "| job | side | call s | start -> saved s | process s | CPU s | peak RSS GB | perplexity | reloaded | load before -> after |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("skipped") or r.get("error"):
            why = (r.get("skipped") or "failed: " + r["error"]).replace("|", "\\|")
            lines.append(f"| {r['job']} | {r['side']} | {why} | | | | | | | {r['load']} |")
            continue
        rss = None if r.get("peak_rss_bytes") is None else r["peak_rss_bytes"] / 1e9
        reloaded = _reloaded_cell(r)
        lines.append(
            f"| {r['job']} | {r['side']} | {_fmt(r.get('call_s'), '.2f')} | {_fmt(_to_saved(r), '.2f')} | "
            f"{_fmt(r.get('process_s'), '.2f')} | "
            f"{_fmt(r.get('cpu_s'), '.2f')} | {_fmt(rss, '.3f')} | {_fmt(r.get('ppl'), '.2f')} | {reloaded} | "
            f"{r['load']} |"
        )
    lines.append("")
    by_job: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if not r.get("skipped") and not r.get("error"):
            by_job.setdefault(r["job"], {})["ours" if r["side"] == "llmc-fsm" else "peer"] = r
    for job, sides in by_job.items():
        peer = by_job.get(base_job(job), {}).get("peer")
        if "ours" in sides and peer is not None:
            o, p = sides["ours"], peer
            parts = [f"{job}: ours / llmcompressor ({base_job(job)}), same run"]
            o["to_saved_s"], p["to_saved_s"] = _to_saved(o), _to_saved(p)
            if "ppl" not in o and o.get("ppl_reloaded") and p.get("ppl"):  # a -cli row: only the reloaded model
                parts.append(f"reloaded perplexity / peer's in memory {o['ppl_reloaded'] / p['ppl']:.2f}x")
            for key, label in (("call_s", "call"), ("to_saved_s", "start -> saved"), ("process_s", "process"),
                               ("cpu_s", "CPU"),
                               ("peak_rss_bytes", "peak RSS"), ("ppl", "perplexity"),
                               ("ppl_reloaded", "reloaded perplexity")):
                if o.get(key) and p.get(key):
                    parts.append(f"{label} {o[key] / p[key]:.2f}x")
            lines.append("- " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default=",".join(JOBS),
                        help=f"comma-separated, of: {', '.join(JOBS)}; <job>-cli: the same through `llmc-fsm oneshot`")
    parser.add_argument("--eval-windows", type=int, default=40, help="0: no perplexity (save and reload still run)")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--autoround-iters", type=int, default=200, help="AutoRoundModifier iters, both sides")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--force-peer", action="store_true", help=f"run the peer even at load average >= {QUIET}")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--write-docs", action="store_true", help=f"write/replace '{SECTION}' in docs/benchmarks.md")
    parser.add_argument("--worker", choices=sorted([*JOBS, *(f"{j}-cli" for j in JOBS)]), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        row = worker(args)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        row.update({"process_s": time.perf_counter() - T_START, "cpu_s": usage.ru_utime + usage.ru_stime})
        print(json.dumps(row), flush=True)
        return 0
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    unknown = [j for j in jobs if base_job(j) not in JOBS]
    if unknown:
        parser.error(f"unknown job(s) {', '.join(unknown)}; choose from {', '.join(JOBS)}")
    from llmc_fsm.models.known import known_model_dir

    model_dir = str(known_model_dir("smollm2-135m"))
    rows: list[dict[str, Any]] = []
    peer_ran: set[str] = set()
    for job in jobs:
        load = loadavg()
        row = _ours(job, model_dir, args)
        rows.append({**row, "job": job, "load": f"{load} -> {loadavg()}"})
        print(f"[bench] {job} ours: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        if args.no_peer or base_job(job) in peer_ran:
            continue
        peer_ran.add(base_job(job))
        job = base_job(job)
        load = loadavg()
        if float(load) >= QUIET and not args.force_peer:
            rows.append({"job": job, "side": "llmcompressor", "load": load,
                         "skipped": f"not run: load average {load} >= {QUIET} (--force-peer runs it)"})
        else:
            row = _peer(job, model_dir, args)
            rows.append({**row, "job": job, "load": f"{load} -> {loadavg()}"})
        print(f"[bench] {job} peer: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    section = render(rows, args)
    print(section)
    if args.write_docs:
        write_docs(section, SECTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
