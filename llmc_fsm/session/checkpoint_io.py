"""Session checkpoint files: ``session.json`` + ``tensors-<digest>.safetensors``, written so a kill never loses one.

See :mod:`llmc_fsm.session.checkpoint` for what a checkpoint holds. The tensors of a
state dict go to safetensors (keyed by their path in the dict), everything else
to JSON, where a tensor is replaced by ``{"__tensor__": key}``. No pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from llmc_fsm.core.errors import CheckpointError

__all__ = ["FORMAT", "MANIFEST", "VERSION", "read_checkpoint", "write_checkpoint"]

FORMAT = "llmc-fsm-session"
VERSION = 1
#: The manifest file of a checkpoint directory.
MANIFEST = "session.json"
#: The lock file every save holds while it writes the directory (threads and processes alike).
LOCK = ".session.lock"
_TENSOR = "__tensor__"


def _split(value: Any, path: str, tensors: dict[str, Any]) -> Any:

    if isinstance(value, torch.Tensor):
        key = path if path not in tensors else f"{path}#{len(tensors)}"
        tensors[key] = value.detach().to("cpu").clone().contiguous()
        return {_TENSOR: key}
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                msg = f"checkpoint state at {path or '<root>'}: keys must be strings, got {k!r}"
                raise TypeError(msg)
            out[k] = _split(v, f"{path}/{k}" if path else k, tensors)
        return out
    if isinstance(value, list | tuple):
        return [_split(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    msg = f"checkpoint state at {path}: a {type(value).__name__} is neither a tensor nor a JSON value"
    raise TypeError(msg)


def _join(value: Any, tensors: Mapping[str, Any]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, tensors) for v in value]
    return value


#: A tensor file's name: ``tensors-`` + the first 16 hex digits of its SHA-256.
_TENSOR_FILE = re.compile(r"tensors-(?P<digest>[0-9a-f]{16})\.safetensors")
#: A temporary file :func:`_write_atomic` writes (``.<name>.<pid>-<8 hex>.tmp``, with the writer's process id).
_TEMP_FILE = re.compile(r"\.(?:session\.json|tensors-[0-9a-f]{16}\.safetensors)(?:\.(?P<pid>\d+)-[0-9a-f]{8})?\.tmp")


def _write_atomic(target: Path, data: bytes) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _previous_tensor_file(path: Path) -> str | None:
    """The tensor file the checkpoint already in ``path`` names (``None``: no readable manifest, or a name that is
    not one :func:`write_checkpoint` writes)."""
    try:
        name = json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("tensors")
    except (OSError, ValueError, AttributeError):  # no manifest, not JSON, not an object
        return None
    return name if isinstance(name, str) and _TENSOR_FILE.fullmatch(name) else None


def _foreign_manifest(path: Path) -> str | None:
    """Why ``path/session.json`` is not a manifest :func:`write_checkpoint` wrote (another program's file, which a
    save replaced without a word: found by a tester), or ``None`` (ours, or none)."""
    try:
        text = (path / MANIFEST).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        return f"unreadable: {exc}"
    try:
        data = json.loads(text)
    except ValueError:
        return "not JSON"
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        return f"format {found!r}, not {FORMAT!r}"
    return None


def _written_here(entry: Path) -> bool:
    """Whether ``entry`` is a tensor file :func:`write_checkpoint` wrote: its name holds its own SHA-256 prefix (a
    save killed after its tensor file and before its manifest leaves one that no manifest names)."""
    match = _TENSOR_FILE.fullmatch(entry.name)
    if match is None or not entry.is_file():
        return False
    try:
        with open(entry, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()[:16] == match["digest"]
    except OSError:
        return False


def _abandoned_temp(entry: Path) -> bool:
    """Whether ``entry`` is a temporary file of :func:`_write_atomic` whose process no longer runs."""
    match = _TEMP_FILE.fullmatch(entry.name)
    return match is not None and (match["pid"] is None or not _running(int(match["pid"])))


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):  # exists but not ours, or not a usable pid: leave it be
        return True
    return True


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(state: Mapping[str, Any], path: str | Path) -> Path:
    """Write a session state dict to the directory ``path`` (created if needed); return it.

    The tensor file goes first, then ``session.json`` replaces the previous
    manifest in one rename; last, the tensor file the previous manifest named is
    removed, and so is what killed saves left: a ``tensors-<16 hex>.safetensors``
    whose SHA-256 starts with those 16 hex digits, and the temporary files
    ``.session.json.<pid>-<hex>.tmp`` / ``.tensors-<16 hex>.safetensors.<pid>-<hex>.tmp``
    of a process that no longer runs. Nothing else in the directory is touched
    (every ``tensors-*.safetensors`` and ``.*.tmp`` was removed, other programs'
    files too, found by a tester). A kill at any point leaves a loadable checkpoint
    (the new one, or the previous one). Saves to one directory take turns, in
    threads and processes alike: each holds the OS lock on ``.session.lock`` there
    (the file stays; a killed holder's lock goes with its process).

    Raises:
        TypeError: a value in ``state`` is neither a tensor nor a JSON value (nothing written).
        NotADirectoryError: ``path`` is a file (nothing written).
        FileExistsError: ``path/session.json`` exists and is not a session checkpoint (nothing written).
        OSError: the directory cannot be written, or a file in it (a full disk): one line naming the file; the
            previous checkpoint is kept and the new tensor file removed.
    """
    from safetensors.torch import save as save_tensors

    path = Path(path)
    tensors: dict[str, Any] = {}
    meta = _split(state, "", tensors)
    payload = save_tensors(tensors)
    digest = hashlib.sha256(payload).hexdigest()
    tensor_name = f"tensors-{digest[:16]}.safetensors"
    manifest = {"format": FORMAT, "version": VERSION, "tensors": tensor_name, "sha256": digest, "state": meta}
    text = json.dumps(manifest, indent=1, allow_nan=True).encode("utf-8")
    if path.exists() and not path.is_dir():
        msg = f"cannot save a session checkpoint to {path}: it is a file, not a directory; give a directory path"
        raise NotADirectoryError(msg)
    foreign = _foreign_manifest(path)
    if foreign is not None:
        msg = (
            f"cannot save a session checkpoint to {path}: its {MANIFEST} is not an llmc-fsm session checkpoint "
            f"({foreign}) and would be replaced; save to another directory, or remove that file first"
        )
        raise FileExistsError(msg)
    path.mkdir(parents=True, exist_ok=True)
    with _locked(path):  # one writer at a time: another's cleanup removed a tensor file before its manifest named it
        previous = _previous_tensor_file(path)
        _write_both(path, tensor_name, payload, text, kept=previous is not None)
        _fsync_dir(path)
        if previous is not None and previous != tensor_name:
            (path / previous).unlink(missing_ok=True)
        for entry in path.iterdir():  # what killed saves left (normally nothing, so nothing is hashed)
            if entry.name != tensor_name and (_abandoned_temp(entry) or _written_here(entry)):
                entry.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``path/.session.lock`` (an OS lock: threads and processes wait for each other; a killed holder's lock is
    released with its process). Two threads saving one session to one directory left, in 8 of 40 tries, a manifest
    naming a tensor file the other save's cleanup had removed (found by a tester).

    Raises:
        OSError: the lock file cannot be created (a read-only directory): one line naming it; nothing written.
    """
    lock = FileLock(path / LOCK, fallback_to_soft=False)
    try:
        lock.acquire()
    except OSError as exc:
        kept = "the previous checkpoint there was kept" if (path / MANIFEST).exists() else "nothing was written"
        msg = f"cannot save a session checkpoint: creating {path / LOCK} failed ({exc.strerror or exc}); {kept}"
        raise OSError(msg) from exc
    try:
        yield
    finally:
        lock.release()


def _write_both(path: Path, tensor_name: str, payload: bytes, text: bytes, *, kept: bool) -> None:
    """Write the tensor file, then the manifest; when either fails (a full disk), remove the tensor file this call
    created (a full disk left a ``tensors-*.safetensors`` beside the previous checkpoint, and an ``OSError`` naming
    no file: found by a tester).

    Raises:
        OSError: one line naming the file that could not be written, its cause, and whether the previous
            checkpoint (``kept``) is still there; the original error is its ``__cause__``.
    """
    created = not (path / tensor_name).exists()
    target = path / tensor_name
    try:
        _write_atomic(target, payload)
        target = path / MANIFEST
        _write_atomic(target, text)
    except OSError as exc:
        if created:
            (path / tensor_name).unlink(missing_ok=True)
        then = "the previous checkpoint there was kept" if kept else "no checkpoint was saved there"
        msg = f"cannot save a session checkpoint: writing {target} failed ({exc.strerror or exc}); {then}"
        raise OSError(msg) from exc


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read the state dict written by :func:`write_checkpoint` (tensors on the CPU).

    The read holds the lock saves hold (``path/.session.lock``, where a save left it): a save into the same
    directory by another thread or process waits, and so does this read while one runs. One read in 300 beside a
    save in another process failed with "its tensor file ... cannot be read (No such file or directory)": it read
    the manifest, then the save's cleanup removed the tensor file it named (found by a tester). Where the lock
    cannot be taken (no lock file: a checkpoint copied elsewhere, nothing is created; a read-only one), a read
    whose manifest changed while it read is read again.

    Raises:
        CheckpointError: no checkpoint at ``path``, or its files are damaged or missing (the message says which);
            a checkpoint that kept changing while it was read (saves running without the lock) says so.
    """
    path = Path(path)
    with _read_locked(path) as locked:
        for _ in range(_READ_TRIES):
            manifest_text = _manifest_text(path)
            try:
                return _read_once(path, manifest_text)
            except CheckpointError:
                if locked or _manifest_now(path) == manifest_text:
                    raise  # the files as they are on disk: damage, not a save running beside this read
    msg = (
        f"session checkpoint {path} changed while it was read, {_READ_TRIES} times (saves into it are running); "
        "read it again once they are done"
    )
    raise CheckpointError(msg)


@contextlib.contextmanager
def _read_locked(path: Path) -> Iterator[bool]:
    """Hold ``path/.session.lock`` as :func:`_locked` does when a save left one there and it can be opened; yield
    whether it is held (a read creates no file: a checkpoint copied without it is read unlocked)."""
    if not (path / LOCK).is_file():
        yield False
        return
    lock = FileLock(path / LOCK, fallback_to_soft=False)
    try:
        lock.acquire()
    except OSError:  # a read-only lock file or directory: read without it
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


#: How many times :func:`read_checkpoint` reads a checkpoint whose manifest a save replaced while it read.
_READ_TRIES = 5


def _manifest_now(path: Path) -> str | None:
    """The text of ``path/session.json`` now, or ``None`` when it cannot be read."""
    try:
        return (path / MANIFEST).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _manifest_text(path: Path) -> str:
    """The text of ``path/session.json``.

    Raises:
        CheckpointError: no checkpoint at ``path``, or the manifest cannot be read (not UTF-8: damaged).
    """
    manifest_path = path / MANIFEST
    try:
        return manifest_path.read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        where = "the directory does not exist" if not path.exists() else f"it has no {MANIFEST}"
        msg = f"no session checkpoint at {path}: {where} (write one with session.save(path))"
        raise CheckpointError(msg) from None
    except UnicodeDecodeError as exc:
        msg = f"session checkpoint {manifest_path} is damaged ({type(exc).__name__}: {exc}); use an earlier one"
        raise CheckpointError(msg) from None
    except OSError as exc:  # e.g. no permission: not damage
        msg = f"session checkpoint {path}: its {MANIFEST} cannot be read ({exc.strerror or exc})"
        raise CheckpointError(msg) from None


def _read_once(path: Path, text: str) -> dict[str, Any]:
    """The state dict of the checkpoint in ``path`` whose manifest reads ``text``.

    Raises:
        CheckpointError: the manifest or the tensor file it names is damaged or missing.
    """
    from safetensors.torch import load as load_tensors

    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(text)
        tensor_file = path / manifest["tensors"]
        expected = manifest["sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        msg = f"session checkpoint {manifest_path} is damaged ({type(exc).__name__}: {exc}); use an earlier one"
        raise CheckpointError(msg) from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        msg = (
            f"{manifest_path} is not an llmc-fsm session checkpoint of format version {VERSION} "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})"
        )
        raise CheckpointError(msg)
    try:
        payload = tensor_file.read_bytes()
    except OSError as exc:
        msg = f"session checkpoint {path}: its tensor file {tensor_file.name} cannot be read ({exc.strerror})"
        raise CheckpointError(msg) from None
    if hashlib.sha256(payload).hexdigest() != expected:
        msg = f"session checkpoint {path}: {tensor_file.name} does not match the SHA-256 in {MANIFEST} (damaged)"
        raise CheckpointError(msg)
    return _join(manifest["state"], load_tensors(payload))
