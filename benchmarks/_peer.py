"""Run peer (llmcompressor) benchmark scripts in their own virtual environment.

The peer, ``llmcompressor==0.14.0.1``, pins its own dependency set and must not
be installed next to ``llmc_fsm``.  :func:`ensure_peer_venv` creates a separate
venv once (default ``/tmp/llmc-fsm-peer-venv``, override with the
``LLMC_FSM_PEER_VENV`` environment variable) and :func:`run_peer_script` runs a
script inside it and returns the JSON object the script printed last.

Command line::

    python benchmarks/_peer.py                       # create / check the venv
    python benchmarks/_peer.py SCRIPT.py [ARGS...]   # run a peer script, print its JSON
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

__all__ = ["PEER_REQUIREMENTS", "default_peer_venv", "ensure_peer_venv", "run_peer_script"]

log = logging.getLogger(__name__)

#: Pinned packages installed in the peer venv. ``torch`` matches the main venv so
#: that both sides use the same kernels; the CPU wheel is picked up from the
#: configured pip find-links / index.
PEER_REQUIREMENTS: tuple[str, ...] = ("torch==2.13.0", "llmcompressor==0.14.0.1")

REPO_ROOT = Path(__file__).resolve().parent.parent
_MARKER = ".llmc_fsm_peer_ok"


def default_peer_venv() -> Path:
    """Return the peer venv location: ``$LLMC_FSM_PEER_VENV`` or ``/tmp/llmc-fsm-peer-venv``."""
    return Path(os.environ.get("LLMC_FSM_PEER_VENV", "/tmp/llmc-fsm-peer-venv"))


def _venv_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_peer_venv(path: Path | None = None) -> Path:
    """Create the peer venv at ``path`` if needed and return its Python executable.

    The venv counts as ready when it holds a marker file written after a
    successful install whose content equals :data:`PEER_REQUIREMENTS`; otherwise
    ``pip install`` runs (again) with those pins.  The first call downloads a few
    hundred MB and takes minutes.

    Raises:
        RuntimeError: venv creation or ``pip install`` failed (the pip output is
            included in the message).
    """
    path = Path(path) if path is not None else default_peer_venv()
    python = _venv_python(path)
    marker = path / _MARKER
    wanted = "\n".join(PEER_REQUIREMENTS)
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    if not python.exists():
        log.info("creating peer venv at %s", path)
        venv.EnvBuilder(with_pip=True, clear=False).create(path)
    cmd = [str(python), "-m", "pip", "install", *PEER_REQUIREMENTS]
    log.info("installing peer packages: %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        msg = (
            f"installing the peer packages into {path} failed (exit {proc.returncode}); "
            f"command: {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
        raise RuntimeError(msg)
    marker.write_text(wanted)
    return python


def _last_json(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    msg = "the peer script printed no JSON object line on stdout"
    raise RuntimeError(msg)


def run_peer_script(
    script: str | os.PathLike[str],
    args: list[str] | tuple[str, ...] = (),
    *,
    venv_path: Path | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Run ``script`` with the peer venv's Python and return the last JSON object it printed.

    The repository root is put on ``PYTHONPATH`` so a peer script can import
    ``llmc_fsm.data.protocol`` (same tokenisation / perplexity protocol as ours).  The
    script's stderr is passed through to ours (progress, logs).

    Raises:
        RuntimeError: the script exited non-zero or printed no JSON object line.
        subprocess.TimeoutExpired: ``timeout`` seconds passed.
    """
    python = ensure_peer_venv(venv_path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [str(python), str(script), *map(str, args)]
    log.info("running peer: %s", " ".join(cmd))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        msg = f"peer script {script} exited with {proc.returncode}; stdout tail:\n{proc.stdout[-4000:]}"
        raise RuntimeError(msg)
    return _last_json(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not argv:
        print(ensure_peer_venv())
        return 0
    result = run_peer_script(argv[0], argv[1:])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
