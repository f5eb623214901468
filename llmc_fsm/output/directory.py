"""The output directory of the one-shot job, checked before any work: writable, empty or replaceable, not the source.

* :func:`check_output_dir` — every check that needs no model (exists, empty, writable, not the working directory);
* :func:`check_output_not_source` — not the directory the model is read from, nor one containing it or inside it.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

from llmc_fsm.models.hf_io import looks_like_hub_id
from llmc_fsm.models.known import KNOWN_MODELS, cache_root
from llmc_fsm.output.workdir import published_leftover, work_dir_path

__all__ = ["check_output_dir", "check_output_not_source"]


#: A non-empty directory holding one of these may be replaced with overwrite=True.
_MODEL_DIR_MARKERS = ("config.json", "recipe.yaml", "report.json", "model.safetensors")


def _is_mount_point(path: Path, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether ``path`` is a mount point: ``os.path.ismount`` (another device than its parent), or listed in
    ``/proc/self/mountinfo`` (Linux), which also shows a bind mount within one filesystem (``docker -v`` of a host
    directory on the same disk, ``mount --bind``), where device and parent agree. Renaming it fails with ``EBUSY``."""
    if os.path.ismount(path):
        return True
    try:
        with open(mountinfo, encoding="utf-8") as mounts:
            points = {line.split()[4] for line in mounts if len(line.split()) > 4}
    except OSError:
        return False
    decoded = {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in points}  # "\040": a space
    return str(path) in decoded


def check_output_dir(output_dir: str | os.PathLike[str] | None, overwrite: bool) -> Path | None:
    """The resolved output directory, checked before any model work (``None`` when not given).

    Raises:
        FileExistsError: it exists and is a file, or is non-empty without ``overwrite``, or ``overwrite`` would
            replace a directory that is not a model output.
        ValueError: it is the working directory or contains it, a mount point, or ``-``.
        NotADirectoryError: its first existing parent is a file (``README.md/sub``).
        PermissionError: its first existing parent is not writable.

    The directory itself is created later, with its work directory
    (:meth:`llmc_fsm.output.workdir.WorkDir.claim`), still before any model work.
    """
    if output_dir is None:
        return None
    if str(output_dir) == "-":
        msg = (
            "output '-': the output is a model directory, which cannot go to standard output; give a directory "
            "(e.g. --output out/my-model)"
        )
        raise ValueError(msg)
    path = Path(output_dir).expanduser().resolve()
    if path.exists() and not path.is_dir():
        msg = (
            f"output {str(path)!r} exists and is not a directory; choose a new directory for the output (e.g. "
            "--output out/my-model), or move the file away"
        )
        raise FileExistsError(msg)
    cwd = Path.cwd().resolve()
    if path == cwd or path in cwd.parents:
        msg = (
            f"output directory {str(path)!r} is the current directory or contains it, and the output replaces the "
            "whole directory; choose a new directory (e.g. --output out/my-model)"
        )
        raise ValueError(msg)
    if path.is_dir() and _is_mount_point(path):
        msg = (
            f"output directory {str(path)!r} is a mount point, which the output cannot replace (it is written "
            f"beside the directory and then renamed into place); pass a directory inside it, e.g. "
            f"{str(path / 'model')!r}"
        )
        raise ValueError(msg)
    if path.is_dir() and any(path.iterdir()):
        replaceable = any((path / name).exists() for name in _MODEL_DIR_MARKERS)
        if not overwrite and not replaceable:  # --overwrite would be refused too: do not suggest it (a newcomer's
            msg = (  # case: the README's out/ holding other outputs, given as the output directory)
                f"output directory {str(path)!r} exists and holds other files (not a model directory: none of "
                f"{', '.join(_MODEL_DIR_MARKERS)}), which the output never replaces; choose a new directory, e.g. "
                f"{str(path / 'my-model')!r}"
            )
            raise FileExistsError(msg)
        if not overwrite:
            msg = (
                f"output directory {str(path)!r} exists and is not empty; pass overwrite=True (--overwrite) to "
                "replace it"
            )
            leftover = published_leftover(path)  # the finished run that wrote it was killed before removing it
            if (work_dir_path(path) / "fingerprint.json").is_file() and not leftover:  # the old output stays
                msg += (
                    f". A run replacing it (interrupted, or still running) keeps its progress in "
                    f"{str(work_dir_path(path))!r}: to continue an interrupted one, run the same command with "
                    "--overwrite --resume (overwrite=True, resume=True)"
                )
            elif (path / "report.json").is_file():
                msg += ". It holds a finished run (report.json), so there is nothing to resume"
                if not _is_quantized_dir(path):  # a quantized model is not compressed further: no advice to (the
                    msg += (  # full-precision model named as the one to start from misled a resume; a tester)
                        "; to compress that model further, give it as the model (model=DIR, --model DIR) with a new "
                        "output directory"
                    )
                if leftover:
                    msg += (
                        f". {str(work_dir_path(path))!r} is left over from that run (stopped before removing it): "
                        "nothing in it is to resume, delete it"
                    )
            raise FileExistsError(msg)
        if not replaceable:
            msg = (
                f"output directory {str(path)!r} does not look like a model directory (none of "
                f"{', '.join(_MODEL_DIR_MARKERS)}); overwrite=True (--overwrite) only replaces an earlier output or a "
                "model directory, never other files. Choose a new directory or empty this one yourself"
            )
            raise FileExistsError(msg)
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        msg = f"cannot create the output directory {str(path)!r}: {str(parent)!r} is a file, not a directory"
        raise NotADirectoryError(msg)
    if not os.access(parent, os.W_OK):
        msg = (
            f"cannot write the output directory {str(path)!r}: cannot create files in {str(parent)!r} "
            f"({_not_writable_because(parent)})"
        )
        raise PermissionError(msg)
    return path


def _not_writable_because(directory: Path) -> str:
    """Why ``os.access(directory, os.W_OK)`` is false: ``Read-only file system`` on a read-only mount (where a
    writable mode says "Permission denied" wrongly: the mount, not the mode, is to change), else ``Permission
    denied``."""
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return os.strerror(errno.EROFS) if read_only else os.strerror(errno.EACCES)


def check_output_not_source(output_dir: Any, model: Any) -> None:
    """Refuse an output directory that is, contains, or is inside the directory the model is read from.

    ``model`` is a directory path, a known model name (its cache directory), a Hugging Face Hub model ID (its folder
    in the Hugging Face cache) or a loaded transformers model (its ``name_or_path``). The output replaces its
    whole directory when it is written, so even with ``overwrite`` the source model would be lost.

    Raises:
        ValueError: it is; nothing was read or written.
    """
    if output_dir is None:
        return

    out = Path(output_dir).expanduser().resolve()
    candidates = [model] if isinstance(model, str | os.PathLike) else [getattr(model, "name_or_path", None)]
    for candidate in candidates:
        if not isinstance(candidate, str | os.PathLike) or not os.fspath(candidate):
            continue
        source = Path(candidate).expanduser().resolve()
        known = isinstance(candidate, str) and candidate in KNOWN_MODELS and not source.is_dir()
        if known:  # read from its cache directory, which need not exist yet
            source = (cache_root() / "models" / candidate).resolve()
        hub = not known and not source.is_dir() and isinstance(candidate, str) and looks_like_hub_id(candidate)
        if hub:
            source = _hub_repo_folder(candidate)  # its snapshots and blobs in the Hugging Face cache
        if not (known or hub or source.is_dir()):
            continue
        example = f"{os.fspath(candidate).rsplit('/', 1)[-1]}-compressed" if hub else str(source) + "-compressed"
        suggestion = f"choose a new directory (e.g. {example!r})"
        if out == source or out in source.parents:
            relation = "is" if out == source else "contains"
            msg = (
                f"output directory {str(out)!r} {relation} the directory the model is read from ({str(source)!r}), "
                f"and the output replaces the whole directory: {suggestion}"
            )
            raise ValueError(msg)
        if source in out.parents:
            msg = (
                f"output directory {str(out)!r} is inside the directory the model is read from ({str(source)!r}): "
                f"the output and its work directory would be mixed into the model's files: {suggestion}"
            )
            raise ValueError(msg)


def _hub_repo_folder(repo_id: str) -> Path:
    """The Hugging Face cache's folder of the model ``repo_id`` (``HF_HUB_CACHE/models--org--name``: its snapshots,
    whose files link into its blobs), which need not exist yet. An output there replaced a snapshot's links with the
    compressed model, and the next run read that as the model (found by a tester)."""
    from huggingface_hub import constants

    return (Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))).resolve()


def _is_quantized_dir(path: Path) -> bool:
    """Whether ``path/config.json`` carries a ``quantization_config`` (unreadable or absent: ``False``)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("quantization_config") is not None
