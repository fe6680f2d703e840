"""``drive.mount`` for tests: the "Drive" is the folder ``$CKPTSDK_DRIVE_ROOT`` names.

On Colab, ``drive.mount("/content/drive")`` makes ``/content/drive/MyDrive``, which is where
``drive://`` URLs resolve by default. Here the test sets ``CKPTSDK_DRIVE_ROOT`` to a folder under
its ``tmp_path`` (its "MyDrive"), and mounting only checks that it is there: nothing is written
outside the test's folder, and the notebook's ``drive://`` URLs land in it.
"""

from __future__ import annotations

import os

__all__ = ["mount"]


def mount(mountpoint: str, force_remount: bool = False, timeout_ms: int = 120000, readonly: bool = False) -> None:
    """Check the simulated Drive (``$CKPTSDK_DRIVE_ROOT``) exists, as a mounted Drive would.

    Raises:
        ValueError: ``CKPTSDK_DRIVE_ROOT`` is not set or not a folder (the test forgot to make it).
    """
    root = os.environ.get("CKPTSDK_DRIVE_ROOT", "")
    if not os.path.isdir(root):
        raise ValueError(
            f"fake google.colab: CKPTSDK_DRIVE_ROOT={root!r} is not a folder; the test must create the "
            f"simulated Drive before the notebook mounts {mountpoint}"
        )
    print(f"Mounted at {mountpoint} (simulated: {root})")
