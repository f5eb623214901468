"""``model_free_ptq`` on SmolLM2-135M against llmcompressor==0.14.0.1's, in the same run.

    python benchmarks/model_free_vs_llmcompressor.py                      # W8A8 and FP8_DYNAMIC, 3 rounds
    python benchmarks/model_free_vs_llmcompressor.py --schemes W8A8 --rounds 1

Both sides quantize the same files (the known model's converted directory, float32, one safetensors file) with the
same scheme and ``ignore=["lm_head", "model.embed_tokens"]`` (as llm-compressor's model-free examples: its
``Linear`` target takes every 2-D weight by name, the embedding too), each in a fresh process under
``/usr/bin/time -v`` (wall clock and peak RSS of the whole process: imports, reading, rounding, writing), ours then
the peer's in each round; the table gives each side's medians and their ratio, then whether the two outputs hold
the same tensors (keys, dtypes, values; the group names and other config fields are each tool's own). The peer runs
in the venv named by ``--peer-python`` (default ``/tmp/llmc-fsm-peer-venv/bin/python``) with ``device="cpu"``. The
load average is printed before and after; run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

OURS = (
    "from llmc_fsm import model_free_ptq; "
    "model_free_ptq({src!r}, {out!r}, scheme={scheme!r}, ignore=['lm_head', 'model.embed_tokens'], progress=False)"
)
PEER = (
    "from llmcompressor import model_free_ptq; "
    "model_free_ptq(model_stub={src!r}, save_directory={out!r}, scheme={scheme!r}, "
    "ignore=['lm_head', 'model.embed_tokens'], device='cpu')"
)


def _timed(python: str, code: str) -> tuple[float, float]:
    """Wall seconds and peak RSS (GB) of ``python -c code`` under ``/usr/bin/time -v``."""
    done = subprocess.run(
        ["/usr/bin/time", "-v", python, "-c", code], capture_output=True, text=True, check=False, timeout=1800
    )
    if done.returncode != 0:
        raise RuntimeError(f"{python} failed:\n{done.stderr[-2000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", done.stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    if wall is None or rss is None:
        raise RuntimeError(f"no /usr/bin/time output:\n{done.stderr[-2000:]}")
    hours, minutes, seconds = int(wall.group(1) or 0), int(wall.group(2)), float(wall.group(3))
    return hours * 3600 + minutes * 60 + seconds, int(rss.group(1)) * 1024 / 1e9


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _same_tensors(a: Path, b: Path) -> str:
    ta, tb = _tensors(a), _tensors(b)
    if sorted(ta) != sorted(tb):
        return f"keys differ: {', '.join(sorted(set(ta) ^ set(tb))[:3])}"
    differ = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    return "equal" if not differ else f"{len(differ)} of {len(ta)} differ (e.g. {differ[0]})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schemes", default="W8A8,FP8_DYNAMIC")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peer-python", default="/tmp/llmc-fsm-peer-venv/bin/python")
    args = parser.parse_args(argv)
    from llmc_fsm.models.known import known_model_dir

    src = str(known_model_dir("smollm2-135m"))
    print(f"load before: {Path('/proc/loadavg').read_text().strip()}")
    head = "| scheme | ours wall s | peer wall s | wall ratio | ours peak RSS GB | peer peak RSS GB | RSS ratio |"
    print(f"{head} tensors |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory(prefix="model-free-bench-") as tmp:
        for scheme in args.schemes.split(","):
            ours, peer = [], []
            for r in range(args.rounds):
                mine, theirs = Path(tmp, f"ours-{scheme}-{r}"), Path(tmp, f"peer-{scheme}-{r}")
                ours.append(_timed(sys.executable, OURS.format(src=src, out=str(mine), scheme=scheme)))
                peer.append(_timed(args.peer_python, PEER.format(src=src, out=str(theirs), scheme=scheme)))
            ow, orss = statistics.median(w for w, _ in ours), statistics.median(m for _, m in ours)
            pw, prss = statistics.median(w for w, _ in peer), statistics.median(m for _, m in peer)
            same = _same_tensors(mine, theirs)
            ratios = f"{ow / pw:.2f}x | {orss:.3f} | {prss:.3f} | {orss / prss:.2f}x"
            print(f"| {scheme} | {ow:.2f} | {pw:.2f} | {ratios} | {same} |")
    print(f"load after: {Path('/proc/loadavg').read_text().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
