"""What the import door may open: regular files only, and JSON objects Python can parse.

A FIFO named ``trainer_state.json`` would block ``open()`` forever and a device would stream
without end, so every file the import reads is checked here before anything opens it. Reading
``torch.save`` files is torch_import.py's job, HF Trainer folders hf_folder.py's.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from ckptsdk.errors import ConfigError

__all__ = ["read_json_file", "regular_file"]

_KINDS = (
    (stat.S_ISDIR, "folder"),
    (stat.S_ISFIFO, "named pipe (FIFO)"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def _not_regular(path: str, mode: int) -> ConfigError:
    kind = next((name for test, name in _KINDS if test(mode)), "special file")
    return ConfigError(
        f"refusing to read {path}: it is a {kind}, not a regular file (reading one could block forever "
        "or never end); put the file itself there"
    )


def regular_file(path: str) -> int:
    """Refuse anything at ``path`` but a regular file (symlinks followed); return its size.

    Only ``stat`` runs: nothing is opened, so a FIFO or a device is refused without blocking.

    Raises:
        ConfigError: ``path`` is missing, unreadable, or not a regular file.

    Example:
        >>> import tempfile
        >>> regular_file(tempfile.gettempdir())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ckptsdk.errors.ConfigError: refusing to read ...: it is a folder, not a regular file ...
    """
    try:
        st = os.stat(path)
    except FileNotFoundError as exc:
        raise ConfigError(f"{path} does not exist; check the path") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}; check the path and its permissions") from exc
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    return st.st_size


def read_json_file(path: str) -> dict[str, Any]:
    """The JSON object in the regular file ``path`` (UTF-8).

    Opened non-blocking and checked again on the open descriptor, so a FIFO swapped in after
    :func:`regular_file` still cannot block the read.

    Raises:
        ConfigError: not a regular file, not UTF-8 JSON, nested too deeply for Python's parser,
            or JSON that is not an object (a list, a number); the message names the file.
    """
    regular_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise _not_regular(path, mode)
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}; check the path and its permissions") from exc
    try:
        value = json.loads(raw.decode("utf-8"))
    except RecursionError as exc:
        raise ConfigError(
            f"cannot read {path}: its JSON nests too deeply for Python's parser; it is damaged or not the "
            "file its name says. Replace it with the one the program that wrote the folder saved"
        ) from exc
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(
            f"cannot read {path}: it is not UTF-8 JSON ({exc}); it is damaged or truncated. Replace it with "
            "the one the program that wrote the folder saved"
        ) from exc
    if not isinstance(value, dict):
        raise ConfigError(
            f"cannot read {path}: it holds a JSON {type(value).__name__}, not the object (a {{...}}) expected; "
            "it is damaged or not the file its name says"
        )
    return value
