"""The hidden work directory of a one-shot job with an output directory: claimed before any model work.

For an output directory ``DIR/NAME`` the job works in ``DIR/.NAME.work`` — a
fixed name, so a later run finds it again::

    owner.lock        an OS file lock (filelock) held while the job runs; the kernel
                      releases it when the process ends, even on SIGKILL
    owner.json        pid, host, start time, command, working directory and torch threads of the job that
                      created it
    fingerprint.json  what the result depends on (see :func:`llmc_fsm.oneshot_job.resume.fingerprint`)
    calibration.safetensors, eval_before.json, progress/
                      per-layer progress (see :mod:`llmc_fsm.oneshot_job.resume`)
    output/           the output being written; renamed to NAME once complete
    previous/         an earlier output being replaced (``overwrite``), during the swap
    published.json    the sha256 of the output's report.json, written just before the output is renamed into
                      place: a work directory left beside that output (killed while removing it) is a
                      leftover (:func:`published_leftover`), which a run with ``overwrite`` removes

:meth:`WorkDir.claim` creates it (and any missing parents) before the model is
loaded, so an output path that cannot be written fails at once. A work
directory whose lock is held belongs to a live run and is never touched. One
whose owner is gone is *stale*: without saved layers it is cleared and reused;
with saved layers it is resumed with ``resume=True`` (``--resume``) when its
fingerprint matches, and otherwise reported (size, how to resume or remove it)
and left as it is. On failure (:meth:`WorkDir.abort`) the partial output is
removed; saved layers are kept after an interruption (Ctrl-C, SIGTERM) or any
write failure (:func:`write_failure`: an ``OSError`` such as a full disk or a
vanished folder, or safetensors' ``SafetensorError``, which is not an
``OSError``), and the exception gets a note saying where and that ``--resume``
continues. A write failure that is not an ``OSError`` is raised as one (errno
and the work directory's path), so it reads as one line like any other. An
interruption once the output is in place does not fail the run:
:meth:`WorkDir.publish` finishes removing the work directory and returns (a CI
cancel marked a finished job failed, "nothing written": found by a tester).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from safetensors import SafetensorError, safe_open

from llmc_fsm.output.save import dir_size_bytes
from llmc_fsm.recipes.history import settings_diff
from llmc_fsm.toolkit.distributed import get_world_size, is_distributed, peer_failure

__all__ = [
    "LAYOUT",
    "RANKS_KEY",
    "WorkDir",
    "as_os_error",
    "calibrated_ranks",
    "fingerprint_changes",
    "progress_summary",
    "published_leftover",
    "ranks_note",
    "readable",
    "recover_previous",
    "work_dir_path",
    "write_failure",
]

logger = logging.getLogger(__name__)

_LOCK = "owner.lock"
_OWNER = "owner.json"
_FINGERPRINT = "fingerprint.json"
_PUBLISHED = "published.json"  # the sha256 of the output's report.json, written just before it is renamed into place


def work_dir_path(output: Path) -> Path:
    """``DIR/.NAME.work`` for the output directory ``DIR/NAME``."""
    return output.parent / f".{output.name}.work"


def write_failure(exc: BaseException) -> BaseException | None:
    """The write error behind ``exc`` — ``exc`` itself or one it was raised from or during — or ``None``.

    A write error is an ``OSError`` (``ENOSPC``, a vanished directory, ...) or safetensors'
    ``SafetensorError`` carrying an OS error (what ``safetensors.torch.save_file`` and ``save_pretrained`` raise on a
    full disk); a ``SafetensorError`` about a file's contents (a truncated input checkpoint: "incomplete metadata") is
    a read error, and a context suppressed (``raise ... from None``) is not followed: a corrupt model file was
    reported as "writing failed" on the output (found by a tester).
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) or (isinstance(current, SafetensorError) and _os_error_code(current)):
            return current
        seen.add(id(current))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return None


def _os_error_code(error: BaseException) -> int | None:
    """The errno a safetensors error carries (``IoError(Os { code: 28, ... })``, ``(os error 27)``), else ``None``."""
    found = re.search(r"code: (\d+)", str(error)) or re.search(r"\(os error (\d+)\)", str(error))
    return int(found.group(1)) if found else None


def as_os_error(error: BaseException, path: Path) -> OSError:
    """``error`` (a write failure, see :func:`write_failure`) as an ``OSError`` with an errno, naming ``path``
    (an ``OSError`` is returned as it is)."""
    if isinstance(error, OSError):
        return error
    code = _os_error_code(error)  # IoError(Os { code: 28, kind: StorageFull, ... }), "File too large (os error 27)"
    if code is not None:
        return OSError(code, os.strerror(code), str(path))
    return OSError(errno.EIO, f"writing failed (safetensors: {error})", str(path))


def _not_writable(output: Path, parent: Path, reason: str) -> PermissionError:
    return PermissionError(
        f"cannot write the output directory {str(output)!r}: cannot create files in {str(parent)!r} ({reason})"
    )


def _make_parents(output: Path) -> list[Path]:
    """Create the missing parents of ``output``; return those created, outermost first."""
    missing = []
    parent = output.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    created = []
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue
        except OSError as err:
            _remove_created(created)
            raise _not_writable(output, directory.parent, err.strerror or str(err)) from None
        created.append(directory)
    return created


def _remove_created(created: list[Path]) -> None:
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:
            break


class WorkDir:
    """A claimed work directory (see the module docstring).

    Attributes:
        path: the work directory.
        output: the final output directory.
        resumed: saved progress matched the fingerprint and will be continued.
        resumed_threads: the torch threads the interrupted run used (its ``owner.json``), when resumed and known.
        resumed_ranks: when resumed, the reused layers grouped by the number of ranks that calibrated them
            (:func:`calibrated_ranks`: ``[{"pass": P, "layers": [first, last], "world_size": N}]``); else ``[]``.
    """

    def __init__(self, path: Path, output: Path, lock: FileLock, created: list[Path]) -> None:
        self.path, self.output, self._lock, self._created = path, output, lock, created
        self.resumed = False
        self.resumed_threads: int | None = None  # the torch threads of the run whose progress this one continues
        self.resumed_ranks: list[dict[str, Any]] = []  # how many ranks calibrated the layers it reuses
        self._fresh = False
        self._settled = False
        self._published = False

    @property
    def staging(self) -> Path:
        """Where the output is written before it is renamed into place."""
        return self.path / "output"

    @property
    def progress(self) -> Path:
        """Per-layer progress (see :class:`llmc_fsm.oneshot_job.resume.LayerProgress`)."""
        return self.path / "progress"

    # --- claiming -------------------------------------------------------------------
    @classmethod
    def claim(cls, output: Path) -> WorkDir:
        """Create (with any missing parents) and lock the work directory of ``output``; nothing in it is touched.

        Call :meth:`settle` next, or :meth:`release` on an error before that.

        Raises:
            PermissionError: the output's parent or the work directory cannot be created.
            FileExistsError: another live run holds it, or a file (not a directory) is in its place (named).
        """
        created = _make_parents(output)
        path = work_dir_path(output)
        fresh = not path.exists()
        try:
            path.mkdir(exist_ok=True)
        except OSError as err:
            _remove_created(created)
            if path.exists() or path.is_symlink():  # a file (or a dangling link) where the work directory goes
                msg = (
                    f"cannot write the output directory {str(output)!r}: {str(path)!r}, where the run keeps its work "
                    "directory, exists and is not a directory; remove or rename it"
                )
                raise FileExistsError(msg) from None
            raise _not_writable(output, output.parent, err.strerror or str(err)) from None
        work = cls(path, output, FileLock(path / _LOCK, fallback_to_soft=False), created if fresh else [])
        work._fresh = fresh
        try:
            work._lock.acquire(blocking=False)
        except Timeout:
            raise FileExistsError(work._busy_message()) from None
        return work

    def settle(self, fingerprint: dict[str, Any], *, resume: bool) -> None:
        """Take over what a dead owner left: resume its progress, refuse, or clear it; record this run.

        Raises:
            FileExistsError: (without ``resume``) an interrupted run left saved layers here.
            ValueError: ``resume`` and the saved fingerprint differs (names what changed) or cannot be read.
        """
        self._settle(fingerprint, resume)
        self._write_json(_OWNER, _owner_record())
        self._write_json(_FINGERPRINT, fingerprint)
        self._settled = True

    def release(self) -> None:
        """Give the work directory up before :meth:`settle`: removed if this run created it, else left as it was."""
        if self._fresh:
            self._remove()
        else:
            self._lock.release()

    def _busy_message(self) -> str:
        owner = self._read_json(_OWNER) or {}
        who = f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, since {owner.get('started', '?')}"
        return (
            f"output {str(self.output)!r} is being written by another run ({who}); wait for it to finish or "
            "choose another output directory"
        )

    def _settle(self, fingerprint: dict[str, Any], resume: bool) -> None:
        """Decide what to do with what an earlier (dead) owner left here."""
        summary = progress_summary(self.progress)
        if summary is not None and not resume and _published_here(self.path, self.output):
            logger.warning(
                "removing %s: the run that wrote %s finished (its report.json) and was stopped before removing it",
                self.path,
                self.output,
            )
            summary = None
        if summary is None:
            if resume:
                logger.warning("resume: no saved progress in %s; starting from the first layer", self.path)
            self._clear(keep=())
            return
        if not resume:
            size = dir_size_bytes(self.path) / 1e6
            how = " in one process (without torchrun)" if is_distributed() else ""  # ranks refuse --resume
            msg = (
                f"output {str(self.output)!r}: an interrupted run left its progress in {str(self.path)!r} "
                f"({summary}, {size:.1f} MB); run the same command{how} with --resume (resume=True) to continue it, "
                "or remove that directory to start over"
            )
            raise FileExistsError(msg)
        saved = self._read_json(_FINGERPRINT)
        if not isinstance(saved, Mapping):  # was "(fingerprint.json is missing or unreadable) — changed since that
            msg = (  # run; use the original settings", which no settings could satisfy (found by a tester)
                f"cannot resume from {str(self.path)!r}: its {_FINGERPRINT} (the settings of the interrupted run) is "
                "missing or unreadable, so this run cannot be checked against them; remove that directory to start "
                "over"
            )
            raise ValueError(msg)
        changes = fingerprint_changes(saved, fingerprint)
        if changes:
            renamed_only = len(changes) == 1 and _only_renamed(saved.get("recipe"), fingerprint.get("recipe"))
            advice = (  # a recipe generated from --method names its stage otherwise (found by a tester)
                "resume with the interrupted run's recipe file (--recipe), whose stage names recipe.yaml keeps"
                if renamed_only
                else "use the original settings"
            )
            msg = (
                f"cannot resume from {str(self.path)!r}: {'; '.join(changes)} — changed since that run; {advice}, or "
                "remove that directory to start over"
            )
            raise ValueError(msg)
        inert = _inert_changes(saved, fingerprint)
        threads = (self._read_json(_OWNER) or {}).get("threads")
        self.resumed_threads = threads if isinstance(threads, int) else None
        if threads is not None and threads != _threads():
            logger.warning(
                "the interrupted run used %s torch thread(s), this one %s: the result may differ in the last bits from "
                "an uninterrupted run (pass --threads %s for the same bits)",
                threads,
                _threads(),
                threads,
            )
        unreadable = _first_unreadable(self.progress)
        if unreadable is not None:
            path, layer, index = unreadable
            logger.warning(
                "saved progress %s cannot be read (truncated or corrupt): decoder layer %d%s and the layers after it "
                "are computed again",
                path,
                layer,
                f" of pass {index}" if (self.progress / "pass-1").exists() else "",
            )
        self._clear(keep=("progress", "calibration.safetensors", "eval_before.json"))
        self.resumed = True
        self.resumed_ranks = calibrated_ranks(self.progress)
        note = ranks_note(self.resumed_ranks)  # a torchrun run's layers beside this process's (found by a tester)
        details = "; ".join([summary, *inert, *([] if note is None else [note])])
        logger.warning("resuming from %s (%s)", self.path, details)

    def _clear(self, keep: tuple[str, ...]) -> None:
        for entry in self.path.iterdir():
            if entry.name in (_LOCK, *keep):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    # --- files ------------------------------------------------------------------------
    def _read_json(self, name: str) -> Any:
        try:
            return json.loads((self.path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def _write_json(self, name: str, value: Any) -> None:
        tmp = self.path / f"{name}.partial"
        tmp.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, self.path / name)

    # --- ending -----------------------------------------------------------------------
    def publish(self) -> None:
        """Move the complete :attr:`staging` output into place (replacing an earlier one) and remove the rest.

        An interruption (Ctrl-C, SIGTERM: ``KeyboardInterrupt``) once the output is in place is not raised: the work
        directory is removed all the same, one warning says so, and the call returns (the run is complete).

        Raises:
            OSError: a rename failed; the earlier output is back in place.
            KeyboardInterrupt: an interruption before the output was in place (the earlier output back in place).
        """
        previous = self.path / "previous"
        report = self.staging / "report.json"
        if report.is_file():  # before the rename: a run killed while removing the rest leaves a leftover, known so
            self._write_json(_PUBLISHED, {"report_sha256": _sha256(report)})
        interrupt: KeyboardInterrupt | None = None
        try:  # both renames inside: Ctrl-C right after the first one left the old output in `previous` (a tester)
            if self.output.exists():
                os.rename(self.output, previous)
            os.rename(self.staging, self.output)
        except BaseException as exc:
            if not (isinstance(exc, KeyboardInterrupt) and self.output.exists() and not self.staging.exists()):
                if previous.exists() and not self.output.exists():
                    os.rename(previous, self.output)
                (self.path / _PUBLISHED).unlink(missing_ok=True)  # nothing was published
                raise
            interrupt = exc  # it came once the output was in place
        self._published = True
        try:
            self._remove()
        except KeyboardInterrupt as exc:  # SIGTERM, Ctrl-C: the output is complete, finish the clean-up
            interrupt = exc
            self._remove()
        if interrupt is not None:
            logger.warning(
                "interrupted (%s) after the output was complete in %s: its work directory is removed and the run "
                "finishes",
                "SIGTERM" if type(interrupt).__name__ == "Terminated" else "Ctrl-C",  # the CLI's, not imported here
                self.output,
            )

    def abort(self, exc: BaseException) -> None:
        """Clean up after ``exc``: keep saved layers after an interruption, another rank's failure under
        ``torch.distributed`` (:func:`~llmc_fsm.toolkit.distributed.peer_failure`: a peer died or timed out; until
        session 32 rank 0 removed them while torchrun was stopping it, found by a tester) or a write failure
        (:func:`write_failure`), or when this run resumed them (an earlier run's progress is not this error's to
        discard); else remove everything. The caller raises ``exc`` next.

        Raises:
            OSError: ``exc`` is (or was raised from) safetensors' ``SafetensorError``, which is not an ``OSError``:
                the same failure as an ``OSError`` (its errno, this work directory's path, the note), from ``exc``.
        """
        written = write_failure(exc)
        if not self._settled:
            self.release()
        elif self._published:  # interrupted while removing what is left: the output is complete
            self._remove()
            exc.add_note(f"the output is complete in {str(self.output)!r} (interrupted after it was written)")
        else:
            self._keep_or_remove(exc, written)
        if isinstance(written, SafetensorError) and not isinstance(exc, OSError | KeyboardInterrupt):
            error = as_os_error(written, self.path)
            for note in getattr(exc, "__notes__", ()):
                error.add_note(note)
            raise error from exc

    def _keep_or_remove(self, exc: BaseException, written: BaseException | None) -> None:
        with contextlib.suppress(OSError):  # a vanished output folder: nothing to remove there
            shutil.rmtree(self.staging, ignore_errors=True)
        summary = progress_summary(self.progress)
        stopped = isinstance(exc, KeyboardInterrupt) or peer_failure(exc) is not None  # not this run's mistake
        if summary is not None and (stopped or written is not None or self.resumed):
            how = " in one process (without torchrun)" if is_distributed() else ""  # ranks refuse --resume
            exc.add_note(
                f"progress kept in {str(self.path)!r} ({summary}): run the same command{how} with --resume "
                "(resume=True) to continue, or remove that directory"
            )
            self._lock.release()
            return
        self._remove()

    def _remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._lock.release()
        _remove_created(self._created)


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _published_here(path: Path, output: Path) -> bool:
    """Whether the work directory ``path`` is what a run left after moving its output into place: no output being
    written in it, and ``output/report.json`` is the one its ``published.json`` records (lock not looked at)."""
    try:
        marker = json.loads((path / _PUBLISHED).read_text(encoding="utf-8"))
        return not (path / "output").exists() and marker["report_sha256"] == _sha256(output / "report.json")
    except (OSError, ValueError, KeyError, TypeError):
        return False


def published_leftover(output: Path) -> bool:
    """Whether the work directory of ``output`` is a leftover of the finished run that wrote ``output`` (killed
    while removing it: ``published.json`` names its report) that no live run holds: nothing in it is to resume."""
    path = work_dir_path(output)
    if not _published_here(path, output):
        return False
    lock = _free_lock(path)
    if lock is None:
        return False
    lock.release()
    return True


def _free_lock(path: Path) -> FileLock | None:
    """The lock of the work directory ``path``, acquired, or ``None`` while another run holds it."""
    lock = FileLock(path / _LOCK, fallback_to_soft=False)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        return None
    return lock


def recover_previous(output: Path) -> bool:
    """Put back an earlier output that a run killed while replacing it had moved aside; ``True`` if it did.

    Nothing is done while another run holds the work directory.
    """
    path = work_dir_path(output)
    previous = path / "previous"
    if output.exists() or not previous.is_dir():
        return False
    lock = _free_lock(path)
    if lock is None:
        return False
    try:
        os.rename(previous, output)
    finally:
        lock.release()
    logger.warning("restored %s: a run was killed while replacing it", output)
    return True


def _threads() -> int:

    return torch.get_num_threads()


def _owner_record() -> dict[str, Any]:
    return {
        "threads": _threads(),
        "world_size": get_world_size(),  # the ranks of a torchrun run (a resume continues in one process)
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": sys.argv,
        "cwd": os.getcwd(),  # where the command's relative paths point (report's resume advice names it)
    }


#: The per-layer progress layout file under ``progress/``
#: (written by :class:`llmc_fsm.oneshot_job.resume.LayerProgress`).
LAYOUT = "layout.json"

#: The metadata key, in a saved layer's progress file, of the number of ranks that calibrated the layer (written by
#: :class:`llmc_fsm.oneshot_job.resume.LayerProgress`; files from before 2026-12-07 do not have it).
RANKS_KEY = "world_size"


def fingerprint_changes(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[str]:
    """``"item (what changed)"`` for every item of ``current`` or ``saved`` that differs (empty: same run); an item
    only one of them has (e.g. ``output``: ``quantization_format`` given one time only) differs. A setting that
    cannot change the result is left out (:func:`_inert`: ``fuse_stages`` with one stage to run). A recipe's
    difference names the changed settings and renamed, added or removed stages, not whole stages (``recipe (stage
    'quant_stage' renamed 'quantization_stage' (same modifiers and settings))``)."""
    if not isinstance(saved, Mapping):
        return ["the saved fingerprint (fingerprint.json is missing or unreadable)"]
    changes = []
    for key in dict.fromkeys([*current, *saved]):
        old, new = _without_inert(key, saved, current)
        if old == new or _same_data(key, old, new) or _not_comparable(key, old, new):
            continue
        both = isinstance(old, Mapping) and isinstance(new, Mapping)
        if key in ("model", "tokenizer") and both and "files" in old and "files" in new:
            files = dict.fromkeys([*old["files"], *new["files"]])
            diff = "files changed: " + ", ".join(n for n in files if old["files"].get(n) != new["files"].get(n))
            if old.get("directory") != new.get("directory"):
                diff = f"directory {old.get('directory')!r} -> {new.get('directory')!r}"
        elif key == "tokenizer":
            diff = f"{_tokenizer_named(old)} -> {_tokenizer_named(new)}"
        elif key == "recipe":
            diff = _recipe_diff(old, new)
        else:
            diff = settings_diff(old, new).strip()
        changes.append(f"{key} ({diff})")
    return changes


def _stages_to_run(recipe: Any) -> int | None:
    """How many stages of a fingerprint's ``recipe`` item are not marked applied (``None``: not a recipe's form)."""
    if not _is_recipe(recipe):
        return None
    return sum(1 for body in recipe.values() if not body.get("applied"))


def _inert(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, str]:
    """``{item: setting}`` of the fingerprint settings that cannot change this result, so that a resume with another
    value of them is taken: ``pipeline.fuse_stages`` when both recipes have at most one stage to run (one pass
    either way: :func:`llmc_fsm.oneshot_job.phases.recipe_sessions`). A one-stage run resumed with ``--fuse-stages``
    was refused (found by a tester)."""
    runs = [_stages_to_run(saved.get("recipe")), _stages_to_run(current.get("recipe"))]
    return {"pipeline": "fuse_stages"} if all(n is not None and n <= 1 for n in runs) else {}


def _without_inert(key: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[Any, Any]:
    """The ``key`` items of ``saved`` and ``current`` with the settings of :func:`_inert` left out."""
    old, new = saved.get(key), current.get(key)
    setting = _inert(saved, current).get(key)
    if setting is None or not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return old, new
    return {k: v for k, v in old.items() if k != setting}, {k: v for k, v in new.items() if k != setting}


def _inert_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The settings of :func:`_inert` that differ, in words for the "resuming" line (``"fuse_stages False -> True
    makes no difference here: one stage to run"``)."""
    notes = []
    for key, setting in _inert(saved, current).items():
        old, new = saved.get(key), current.get(key)
        old = old.get(setting) if isinstance(old, Mapping) else None
        new = new.get(setting) if isinstance(new, Mapping) else None
        if old != new:
            notes.append(f"{setting} {old!r} -> {new!r} makes no difference here: one stage to run")
    return notes


def _is_recipe(item: Any) -> bool:
    """Whether a fingerprint's ``recipe`` item has a recipe's form: ``{stage: {"modifiers": [...], ...}}``."""
    return (
        isinstance(item, Mapping)
        and bool(item)
        and all(isinstance(body, Mapping) and isinstance(body.get("modifiers"), list) for body in item.values())
    )


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters with ``...``."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _leaf_diff(old: Any, new: Any, prefix: str) -> list[str]:
    """``"path old -> new"`` for each setting that differs, into mappings and lists of the same length; values cut
    (:func:`_short`)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        return [d for k in dict.fromkeys([*old, *new]) for d in _leaf_diff(old.get(k), new.get(k), f"{prefix}.{k}")]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new, strict=True)) for d in _leaf_diff(a, b, f"{prefix}[{i}]")]
    return [] if old == new else [f"{prefix} {_short(old)} -> {_short(new)}"]


def _modifier_names(body: Mapping[str, Any]) -> str:
    return ", ".join(str(next(iter(m), "?")) if isinstance(m, Mapping) else "?" for m in body["modifiers"]) or "none"


def _stage_diff(name: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The settings of stage ``name`` that differ: per modifier (``stage.Modifier.key old -> new``), a modifier
    replaced or the modifiers' list changed by its classes, and the stage's own keys (``applied``, ``start``)."""
    mods_old, mods_new = old["modifiers"], new["modifiers"]
    if len(mods_old) != len(mods_new):
        diffs = [f"{name} modifiers {_modifier_names(old)} -> {_modifier_names(new)}"]
    else:
        diffs = []
        for a, b in zip(mods_old, mods_new, strict=True):
            label_a = next(iter(a), None) if isinstance(a, Mapping) else None
            label_b = next(iter(b), None) if isinstance(b, Mapping) else None
            if label_a is not None and label_a == label_b:
                diffs += _leaf_diff(a[label_a], b[label_b], f"{name}.{label_a}")
            elif a != b:
                diffs.append(f"{name} modifier {label_a} -> {label_b}")
    for key in dict.fromkeys([*old, *new]):
        if key != "modifiers":
            diffs += _leaf_diff(old.get(key), new.get(key), f"{name}.{key}")
    return diffs


def _recipe_diff(old: Any, new: Any) -> str:
    """What differs between two fingerprints' ``recipe`` items, short: stages renamed (paired by position among the
    names only one of them has; ``stage 'a' renamed 'b' (same modifiers and settings)``), added or removed (by their
    modifiers' classes), and each changed setting (``stage.Modifier.key old -> new``, long values cut). A resume
    whose recipe differed only in its stage's name dumped both recipes, ~950 characters (found by a tester)."""
    if not (_is_recipe(old) and _is_recipe(new)):
        return settings_diff(old, new).strip()
    gone = [n for n in old if n not in new]
    added = [n for n in new if n not in old]
    parts = []
    paired = min(len(gone), len(added))
    for a, b in zip(gone[:paired], added[:paired], strict=True):
        changed = _stage_diff(b, old[a], new[b])
        parts.append(f"stage {a!r} renamed {b!r}" + ("" if changed else " (same modifiers and settings)"))
        parts += changed
    parts += [f"stage {n!r} removed ({_modifier_names(old[n])})" for n in gone[paired:]]
    parts += [f"stage {n!r} added ({_modifier_names(new[n])})" for n in added[paired:]]
    for name in (n for n in new if n in old):
        parts += _stage_diff(name, old[name], new[name])
    kept_old, kept_new = [n for n in old if n in new], [n for n in new if n in old]
    if kept_old != kept_new:
        parts.append(f"stages reordered: {', '.join(map(repr, kept_old))} -> {', '.join(map(repr, kept_new))}")
    return "; ".join(parts)


def _only_renamed(old: Any, new: Any) -> bool:
    """Whether two fingerprints' ``recipe`` items differ only in their stages' names (same stages otherwise, in the
    same order)."""
    if not (_is_recipe(old) and _is_recipe(new)) or len(old) != len(new) or list(old) == list(new):
        return False
    return all(_stage_diff("", a, b) == [] for a, b in zip(old.values(), new.values(), strict=True))


def _not_comparable(key: str, old: Any, new: Any) -> bool:
    """A model directory's files recorded one way (sha256 digests: a calibrated job) and checked the other (sizes and
    modification times: a data-free job): not compared, since the recipe differs then too and is named (a resume
    with another method listed every model file as changed: found by a tester)."""
    if key != "model" or not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return False
    kinds = [{type(v).__name__ for v in (item.get("files") or {}).values()} for item in (old, new)]
    return all(kinds) and kinds[0] != kinds[1]


def _tokenizer_named(item: Any) -> str:
    """The ``tokenizer`` item of a fingerprint in words (:func:`llmc_fsm.oneshot_job.resume.fingerprint`)."""
    if not isinstance(item, Mapping):
        return "the model's own"
    if "directory" in item:
        return f"directory {item['directory']!r}"
    if "object" in item:
        digest = f" (sha256 {item['sha256']})" if "sha256" in item else ""
        return f"a {str(item['object']).rsplit('.', 1)[-1]} object{digest}"
    return repr(item.get("hub id", item.get("name")))


def _same_data(key: str, old: Any, new: Any) -> bool:
    """The calibration data or the model directory named differently but the same (its digest, its files): a text
    file given by a relative path from another directory (``cal.txt`` then ``../run/cal.txt``), a model directory
    copied elsewhere, were refused as changed (found by testers)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return False
    if key in ("model", "tokenizer"):
        return "files" in old and old.get("files") == new.get("files")
    if key != "calibration data":
        return False
    return old.get("sha256") is not None and all(
        old.get(k) == new.get(k) for k in dict.fromkeys([*old, *new]) if k != "source"
    )


def readable(path: Path) -> bool:
    """Whether ``path`` is a safetensors file whose header can be read (a truncated or corrupt one cannot)."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), "pt") as fh:
            fh.metadata()
    except Exception:  # any unreadable file (e.g. truncated by a power loss) ends the saved prefix
        return False
    return True


def _saved_passes(progress: Path) -> list[tuple[int, dict[int, Path]]]:
    """``[(pass, {layer index: file})]`` of the layer files under ``progress``, in pass order."""
    passes = []
    for directory in progress.glob("pass-*"):
        files = {}
        for file in directory.glob("layer-*.safetensors"):
            with contextlib.suppress(ValueError):
                files[int(file.name.removeprefix("layer-").removesuffix(".safetensors"))] = file
        with contextlib.suppress(ValueError):
            passes.append((int(directory.name.removeprefix("pass-")), files))
    return sorted(passes, key=lambda item: item[0])


def _reused(files: Mapping[int, Path]) -> int:
    """How many leading layers of one pass a resumed run reuses: those with a readable file, from layer 0 on."""
    done = 0
    while done in files and readable(files[done]):
        done += 1
    return done


def _first_unreadable(progress: Path) -> tuple[Path, int, int] | None:
    """``(file, decoder layer, pass)`` of the first saved layer file that cannot be read, or ``None``."""
    for index, files in _saved_passes(progress):
        done = _reused(files)
        if done in files:
            return files[done], done, index
    return None


def _ranks_of(file: Path) -> int | None:
    """The number of ranks that calibrated the layer saved in ``file`` (:data:`RANKS_KEY`), ``None`` if not known."""
    try:
        with safe_open(str(file), "pt") as fh:
            value = (fh.metadata() or {}).get(RANKS_KEY)
        return int(value) if value is not None else None
    except (OSError, SafetensorError, ValueError):
        return None


def calibrated_ranks(progress: Path) -> list[dict[str, Any]]:
    """The layers under ``progress`` that a resumed run reuses (as :func:`progress_summary` counts them), grouped into
    runs of consecutive layers of one pass calibrated on the same number of ranks.

    Returns:
        ``[{"pass": P, "layers": [first, last], "world_size": N}]`` in pass and layer order (JSON values);
        ``world_size`` is ``None`` for a file written before it was recorded. A torchrun run killed after 5 of 8
        layers, resumed in one process: ``[{"pass": 0, "layers": [0, 4], "world_size": 2}]``.
    """
    spans: list[dict[str, Any]] = []
    for index, files in _saved_passes(progress):
        for layer in range(_reused(files)):
            ranks = _ranks_of(files[layer])
            last = spans[-1] if spans else None
            if last is not None and last["pass"] == index and last["world_size"] == ranks:
                last["layers"][1] = layer
            else:
                spans.append({"pass": index, "layers": [layer, layer], "world_size": ranks})
    return spans


def ranks_note(spans: list[Mapping[str, Any]]) -> str | None:
    """What a resumed run's report says about the layers an interrupted torchrun run calibrated on several ranks
    (``spans``: :func:`calibrated_ranks`), or ``None`` when no reused layer was calibrated on several ranks.

    ``[{"pass": 0, "layers": [0, 4], "world_size": 2}]`` gives ``"decoder layers 0-4 calibrated on 2 ranks
    (torchrun), the other layers in one process"`` (docs/distributed.md, "Resuming a torchrun run").
    """
    several = [s for s in spans if (s.get("world_size") or 1) > 1]
    if not several:
        return None
    passes = len({s["pass"] for s in spans}) > 1
    parts = []
    for span in several:
        first, last = span["layers"]
        which = f"decoder layer {first}" if first == last else f"decoder layers {first}-{last}"
        where = f"pass {span['pass']} " if passes else ""
        parts.append(f"{where}{which} calibrated on {span['world_size']} ranks")
    return f"{', '.join(parts)} (torchrun), the other layers in one process"


def progress_summary(progress: Path) -> str | None:
    """``"k of N decoder layers done"`` for the saved layers under ``progress`` that a resumed run reuses (per pass,
    the readable files from layer 0 on: a file after an unreadable one is computed again), or ``None`` when no layer
    file is there."""
    saved = _saved_passes(progress)
    if not any(files for _, files in saved):
        return None
    done = sum(_reused(files) for _, files in saved)
    try:
        layout = json.loads((progress / LAYOUT).read_text(encoding="utf-8"))
        layers, passes = int(layout["num_layers"]), int(layout["passes"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{done} decoder layers done"
    if passes == 1:
        return f"{done} of {layers} decoder layers done"
    return f"{done} of {layers * passes} layer passes done ({passes} passes over {layers} decoder layers)"
