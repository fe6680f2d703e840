"""What a ``torch.save`` zip archive may expand to, checked before torch decompresses anything.

torch allocates each record at the size the zip's central directory declares, then inflates
into it: a 1.5 MB file of deflated zeros can make it allocate gigabytes. This module reads that
directory (without inflating a byte) and refuses sizes the file cannot honestly hold. Reading
what the archive contains is torch_import.py's job.
"""

from __future__ import annotations

import os
import zipfile

from ckptsdk.errors import ConfigError
from ckptsdk.format.files.memory import available_memory, describe_size

__all__ = ["MAX_EXPANSION", "MAX_RATIO", "check_torch_archive"]

#: torch.save stores records uncompressed, so an honest archive expands to about its own size.
#: A user's re-zipped file may do better; past this many times the file (plus a small allowance
#: for tiny files) it is refused.
MAX_EXPANSION = 16
_SLACK = 64 << 20
#: One member inflating more than this many times its compressed size (deflate's ceiling is
#: about 1,032) is what zip bombs are made of; members under 1 MiB are not judged by ratio.
MAX_RATIO = 100
_SMALL_MEMBER = 1 << 20
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}  # all torch's reader inflates


def check_torch_archive(path: str) -> int:
    """Refuse a zip archive whose members declare more than the file can honestly hold.

    A file that is not a zip (torch's legacy format: a pickle then raw storages) is bounded by
    its own size and passes. Nothing is decompressed.

    Args:
        path: the ``.pt`` file.

    Returns:
        The bytes the members declare (0 for a legacy file).

    Raises:
        ConfigError: a member stored with a size that differs from its declared size, one that
            inflates more than ``MAX_RATIO`` times, a compression method torch cannot read, a
            total beyond ``MAX_EXPANSION`` times the file, or one beyond the memory there is.
    """
    size = os.path.getsize(path)
    if not zipfile.is_zipfile(path):
        return 0
    try:
        with zipfile.ZipFile(path) as zf:
            members = zf.infolist()  # the central directory only: nothing is inflated
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read {path} as a torch.save checkpoint: its zip directory is damaged ({exc})"
        ) from exc

    def refuse(why: str) -> ConfigError:
        return ConfigError(
            f"refusing to import {path} ({describe_size(size)}): {why}. Nothing was decompressed. A file torch.save "
            "wrote stores its tensors uncompressed; re-save it from the program that wrote it"
        )

    total = 0
    for m in members:
        if m.compress_type not in _METHODS:
            raise refuse(
                f"member {m.filename!r} uses zip compression method {m.compress_type}, which torch cannot read"
            )
        if m.compress_type == zipfile.ZIP_STORED and m.file_size != m.compress_size:
            raise refuse(f"member {m.filename!r} is stored as {m.compress_size} bytes but declares {m.file_size}")
        if m.file_size > _SMALL_MEMBER and m.file_size > MAX_RATIO * max(m.compress_size, 1):
            raise refuse(
                f"member {m.filename!r} would inflate {m.compress_size} bytes to {describe_size(m.file_size)} "
                f"(more than {MAX_RATIO} times: a zip bomb)"
            )
        total += m.file_size
    if total > max(MAX_EXPANSION * size, size + _SLACK):
        raise refuse(f"its members declare {describe_size(total)}, more than {MAX_EXPANSION} times the file")
    room = available_memory()
    if room is not None and total > room:
        raise ConfigError(
            f"cannot import {path}: its tensors need {describe_size(total)} and this process can allocate only "
            f"{describe_size(room)} now; free memory or import on a machine with more"
        )
    return total
