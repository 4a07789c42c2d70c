"""Files are untrusted input: torch files read without running code, paths confined to a directory, atomic writes.

* :func:`load_torch_file` reads a ``torch.save`` file (a Lightning checkpoint, ``meta.pt``) with
  ``torch.load(weights_only=True)``: tensors, containers and plain values only, plus the classes the caller allows
  explicitly (the CLI: the few classes Lightning itself stores in checkpoints). Anything else in the pickle stream (a
  ``__reduce__`` payload, ``os.system``) is refused before it is called.
* :func:`confined` joins a name read from a file to the directory it came from, refusing absolute names, ``..`` and
  symlinks that lead outside.
* :func:`atomic_directory` builds a directory next to its destination and moves it into place at the end: a failure
  half-way leaves the previous contents untouched, and nothing is ever written through a symlink already present in
  the destination. An existing destination is swapped in one step where Linux's ``renameat2(RENAME_EXCHANGE)`` works
  (:func:`exchange`), else by two renames; :func:`interrupted_overwrite` names what a process killed between those
  two renames left behind.
* :func:`check_output` refuses, before any work, an output that is (or holds) a file or directory the run read from
  (``protected``: the model, its tokenizer), and with ``overwrite`` replaces only a directory that carries one of
  the writer's own marker files (``owner_marks``): never a model directory that merely has an export's file names.
* A process killed while it builds an export leaves its hidden ``.<name>.partial-<host>-<pid>-*`` folder:
  :func:`clean_stale_partials` (run by :func:`atomic_directory` before each write) removes those whose process is
  dead on this host, and warns about any other leftover it cannot prove stale (another host, an older name, a
  process still alive, or an interrupted overwrite whose folders :func:`interrupted_overwrite` names).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import hashlib
import logging
import os
import pickle
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, BinaryIO

import torch

log = logging.getLogger(__name__)

_GLOBAL = re.compile(r"GLOBAL ([\w.]+) was not an allowed global|Unsupported global: (?!GLOBAL)([\w.]+)")


def _unpickler_reason(err: Exception) -> str:
    """The one line of torch's weights-only error that says what was wrong (not its advice to drop the check)."""
    text = str(err)
    _, found, rest = text.partition("WeightsUnpickler error:")
    reason = rest.split("Check the documentation", 1)[0].strip() if found else ""
    return reason.splitlines()[0] if reason else text.strip().splitlines()[0]


def load_torch_file(path: str | Path, *, what: str = "checkpoint", allowed: Sequence[Any] = ()) -> Any:
    """``torch.load`` a file without executing code from it (``weights_only=True`` plus an explicit allow-list).

    Args:
        path: The file.
        what: What the file is, for the error message.
        allowed: Classes the file may hold besides tensors, containers and plain values (e.g. Lightning's
            ``AttributeDict``, which ``save_hyperparameters()`` stores).

    Returns:
        The loaded object (tensors on the CPU).

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If the file is not a torch file, is truncated, or holds a Python object outside the allow-list
            (the message names it; nothing was called).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"cannot read {what} {path}: no such file")
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        match = _GLOBAL.search(str(err))
        if match:
            name = next(g for g in match.groups() if g)
            raise ValueError(
                f"cannot read {what} {path}: it asks to load the Python object `{name}`, which lightning_pat refuses "
                "(loading a file never runs code: only tensors, containers, plain values and an explicit "
                "allow-list are read). Re-save the checkpoint without that object, or load it yourself if you "
                "trust the file."
            ) from None
        raise ValueError(
            f"cannot read {what} {path}: not a torch checkpoint or truncated ({_unpickler_reason(err)})"
        ) from None
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError, ValueError, OSError, EOFError on bad bytes
        raise ValueError(
            f"cannot read {what} {path}: not a torch checkpoint or truncated ({type(err).__name__}: {err})"
        ) from None


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, allowed: Callable[[str, str], bool], what: str) -> None:
        super().__init__(file)
        self._allowed, self._what = allowed, what

    def find_class(self, module: str, name: str) -> Any:
        if not self._allowed(module, name):
            raise ValueError(
                f"cannot read {self._what}: it asks to load the Python object `{module}.{name}`, which is not on the "
                "allow-list (loading a file never runs code); refused before anything was called."
            )
        return super().find_class(module, name)


def restricted_unpickle(path: str | Path, *, allowed: Callable[[str, str], bool], what: str) -> Any:
    """Unpickle a file whose globals must pass ``allowed(module, name)`` (for formats that are pickles by design).

    Args:
        path: The file.
        allowed: Whether the pickle may name ``module.name`` (a class it reconstructs, a function it calls).
        what: What the file is, for the error message.

    Returns:
        The unpickled object.

    Raises:
        ValueError: If the file names a global outside the allow-list (nothing was called), or is not a pickle.
    """
    with open(path, "rb") as file:
        try:
            return _AllowListUnpickler(file, allowed, what).load()
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - truncated or not a pickle
            raise ValueError(
                f"cannot read {what}: not a valid file or truncated ({type(err).__name__}: {err})"
            ) from None


def confined(directory: str | Path, name: object, *, what: str) -> Path:
    """``directory / name`` for a ``name`` read from a file, refused if it could lead outside ``directory``.

    Args:
        directory: The directory the file came from.
        name: The relative name found in the file.
        what: Where the name was found, for the error message.

    Returns:
        The joined path (inside ``directory``, also after resolving symlinks).

    Raises:
        ValueError: If ``name`` is not a non-empty string, is absolute, contains ``..``, or resolves (through a
            symlink) to a place outside ``directory``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what}: expected a file name inside {directory}, got {name!r}")
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or ".." in posix.parts or ".." in windows.parts:
        raise ValueError(
            f"{what}: {name!r} is not a plain relative name inside {directory} (absolute names and `..` are refused: "
            "only files inside that directory are read or written)."
        )
    root = Path(directory).resolve()
    path = Path(directory) / name
    target = path.resolve()
    if target != root and root not in target.parents:
        raise ValueError(
            f"{what}: {name!r} leads outside {directory} (a symlink to {target}); only files inside that directory "
            "are read or written. Remove the symlink."
        )
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open()`` gives a new file under the current umask (``0o666 & ~umask``; 0o644 for umask 022).

    Temporary files (``tempfile.mkstemp``: 0o600) that are renamed into place get it, so that a file of ours reads
    like the checkpoints next to it.
    """
    return 0o666 & ~_umask()


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
#: errno values meaning "this OS or file system cannot exchange": fall back to two renames.
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM}


def _renameat2() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 (macOS, musl, Windows)
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def exchange(first: str | Path, second: str | Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where it is unsupported.

    Returns:
        Whether the paths were swapped; ``False`` (nothing changed) if the C library, the kernel or the file system
        cannot exchange.

    Raises:
        OSError: For any other failure (e.g. a path that does not exist).
    """
    function = _renameat2() if sys.platform.startswith("linux") else None
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def interrupted_overwrite(destination: str | Path) -> str | None:
    """What an overwrite of ``destination`` killed between its two renames left, as a sentence (``None``: nothing).

    The previous export is in ``.<name>.old-*/export`` and the new, complete one in ``.<name>.partial-*`` (see
    :func:`atomic_directory`).
    """
    destination = Path(destination).absolute()
    if destination.exists() or not destination.parent.is_dir():
        return None
    old = sorted(p / "export" for p in destination.parent.glob(f".{destination.name}.old-*") if (p / "export").is_dir())
    new = sorted(p for p in destination.parent.glob(f".{destination.name}.partial-*") if p.is_dir())
    if not old:
        return None
    return (
        f"an overwrite of {destination} was interrupted between its two renames (a killed process): the previous "
        f"export is in {old[-1]}" + (f", the new one in {new[-1]}" if new else "") + f". Restore the previous "
        f"export with `mv {old[-1]} {destination}`"
        + (f" (or the new one with `mv {new[-1]} {destination}`)" if new else "")
        + ", or save again."
    )


def check_not_source(destination: Path, protected: Sequence[tuple[str, object]], *, what: str) -> None:
    """Refuse an output that is, or holds, one of the files or directories a run read from.

    Args:
        destination: The absolute output directory.
        protected: ``(what it is, path)`` pairs, e.g. ``("the model", config.name_or_path)``; entries that are not
            existing local paths (``None``, a Hub model id) are skipped.
        what: The caller, for the message.

    Raises:
        ValueError: If ``destination`` resolves to one of them or to a directory above one (naming both).
    """
    target = destination.resolve()
    for label, source in protected:
        if not isinstance(source, (str, Path)) or not str(source):
            continue
        path = Path(source).expanduser()
        if not path.exists():
            continue
        path = path.resolve()
        if target == path or target in path.parents:
            how = "is" if target == path else f"holds {path}, which is"
            raise ValueError(
                f"{what}: the output directory {destination} {how} {label} this export was read from; an export never "
                "replaces what it was made from, whatever overwrite says. Write the export to another directory."
            )


def check_output(
    destination: str | Path,
    *,
    overwrite: bool,
    replaceable: Callable[[str], bool],
    what: str,
    owner_marks: Sequence[str] = (),
    protected: Sequence[tuple[str, object]] = (),
    option: str = "overwrite=True",
) -> Path:
    """Check that :func:`atomic_directory` may write ``destination`` (see there), before any work is done.

    Args:
        destination: The directory to create or replace.
        overwrite: Whether a non-empty ``destination`` may be replaced.
        replaceable: Whether a name found in ``destination`` belongs to what is being written.
        what: The caller's name, for error messages.
        owner_marks: File names one of which a replaced ``destination`` must hold (the writer's own marker: only a
            directory this writer made is replaced); empty: no such check.
        protected: ``(what it is, path)`` of what the output was read from (see :func:`check_not_source`).
        option: How the caller spells ``overwrite=True`` (e.g. ``--overwrite``), for the message.

    Returns:
        The absolute destination (a symlink to a directory resolved).

    Raises:
        ValueError: If ``destination`` is or holds a ``protected`` path.
        FileExistsError: As for :func:`atomic_directory`.
    """
    destination = Path(destination).absolute()
    if destination.is_symlink():
        destination = destination.resolve()
    check_not_source(destination, protected, what=what)
    if destination.exists() and not destination.is_dir():
        raise FileExistsError(f"{what}: {destination} exists and is not a directory.")
    present = sorted(os.listdir(destination)) if destination.is_dir() else []
    if present and not overwrite:
        raise FileExistsError(
            f"{what}: {destination} is not empty ({present[:5]}); pass {option} to replace the export there, or "
            "choose an empty or new directory."
        )
    foreign = [n for n in present if not replaceable(n)]
    if foreign:
        raise FileExistsError(
            f"{what}: {destination} holds files that are not part of an export ({foreign[:5]}); {option} only "
            "replaces an earlier export. Move those files away or choose another directory."
        )
    if present and owner_marks and not any((destination / m).is_file() for m in owner_marks):
        raise FileExistsError(
            f"{what}: {destination} was not written by lightning_pat (it holds none of {list(owner_marks)}, which "
            f"every export of lightning_pat carries): it may be the model directory a run was loaded from, and "
            f"{option} only replaces lightning_pat's own exports. Choose another directory (or remove this one "
            "yourself if it is a copy you no longer need)."
        )
    return destination


def _host_key() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: another user's process; a number no pid can be: keep it
        return True
    return True


def partial_prefix(destination: Path) -> str:
    """The name prefix of the folder an export of ``destination`` is built in: ``.<name>.partial-<host>-<pid>-``."""
    return f".{destination.name}.partial-{_host_key()}-{os.getpid()}-"


def clean_stale_partials(destination: str | Path, *, what: str) -> list[Path]:
    """Remove the ``.<name>.partial-*`` folders of ``destination`` left by a killed save; warn about other leftovers.

    A folder is removed only when it is provably ours and stale: its name carries this host's key and the id of a
    process that no longer exists, and no overwrite of ``destination`` was interrupted between its two renames
    (then the folders are what :func:`interrupted_overwrite` tells the user to restore). Any other ``.partial-``
    folder (another host, a live process, an older name without host and process) is kept and named in a warning.

    Returns:
        The folders removed.
    """
    destination = Path(destination).absolute()
    if not destination.parent.is_dir():
        return []
    name = destination.name
    found = sorted(p for p in destination.parent.glob(f".{glob.escape(name)}.partial-*") if p.is_dir())
    if not found:
        return []
    interrupted = interrupted_overwrite(destination) is not None
    pattern = re.compile(rf"\.{re.escape(name)}\.partial-([0-9a-f]{{8}})-(\d+)-\w+")
    stale: list[Path] = []
    kept: list[Path] = []
    for path in found:
        match = pattern.fullmatch(path.name)
        ours = match is not None and match.group(1) == _host_key() and not path.is_symlink() and not interrupted
        (stale if ours and match is not None and not _alive(int(match.group(2))) else kept).append(path)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    if stale:
        log.warning(
            "%s: removed %d folder(s) left by an earlier save of %s that was killed: %s",
            what, len(stale), destination, ", ".join(str(p) for p in stale),
        )  # fmt: skip
    if kept:
        log.warning(
            "%s: %s has leftover folder(s) that lightning_pat cannot prove stale (another host, a process still "
            "running, an older lightning_pat, or an interrupted overwrite): %s. Remove them once no save is running.",
            what, destination, ", ".join(str(p) for p in kept),
        )  # fmt: skip
    return stale


@contextlib.contextmanager
def atomic_directory(
    destination: str | Path,
    *,
    overwrite: bool,
    replaceable: Callable[[str], bool],
    what: str,
    owner_marks: Sequence[str] = (),
    protected: Sequence[tuple[str, object]] = (),
    option: str = "overwrite=True",
) -> Iterator[Path]:
    """Build a directory in a temporary sibling and move it to ``destination`` when the block succeeds.

    An existing non-empty ``destination`` is refused unless ``overwrite``; with ``overwrite`` it may hold only names
    for which ``replaceable`` is true (the files of an earlier export) and must carry one of ``owner_marks``, and is
    replaced as a whole. If the block raises, the temporary directory is removed and ``destination`` is untouched.
    Stale folders of a killed earlier save are removed first (:func:`clean_stale_partials`).

    Args:
        destination: The directory to create or replace.
        overwrite: Whether a non-empty ``destination`` may be replaced.
        replaceable: Whether a name found in ``destination`` belongs to what is being written (so may be replaced).
        what: The caller's name, for error messages.
        owner_marks: As for :func:`check_output`.
        protected: As for :func:`check_output`.
        option: As for :func:`check_output`.

    Yields:
        The temporary directory to write into.

    Raises:
        ValueError: If ``destination`` is or holds a ``protected`` path.
        FileExistsError: If ``destination`` is a file, or is non-empty and ``overwrite`` is false, or holds names
            that ``replaceable`` rejects (the message names them), or none of ``owner_marks``.
    """
    destination = check_output(
        destination, overwrite=overwrite, replaceable=replaceable, what=what, owner_marks=owner_marks,
        protected=protected, option=option,
    )  # fmt: skip
    destination.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_partials(destination, what=what)
    partial = Path(tempfile.mkdtemp(prefix=partial_prefix(destination), dir=destination.parent))
    try:
        os.chmod(partial, 0o777 & ~_umask())
        yield partial
        if destination.exists() and exchange(partial, destination):
            shutil.rmtree(partial, ignore_errors=True)  # it holds the previous export now
        elif destination.exists():  # no atomic swap here: two renames (a kill between them: interrupted_overwrite)
            old = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=destination.parent))
            os.rename(destination, old / "export")
            try:
                os.rename(partial, destination)
            except BaseException:
                os.rename(old / "export", destination)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(partial, destination)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
