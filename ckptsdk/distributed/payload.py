"""What a distributed checkpoint's manifest tree holds: its format marker, the payload, the file table.

No torch.distributed here: the export of a single file and the CLI detect a distributed
checkpoint through this module without importing the DCP machinery (``manager``, ``storage``).
"""

from __future__ import annotations

from typing import Any

from ckptsdk.errors import CorruptCheckpointError
from ckptsdk.format import codec
from ckptsdk.format.manifest import Manifest

__all__ = ["PAYLOAD_FORMAT", "file_table", "is_payload", "local_file", "read_payload"]


#: The ``format`` of the JSON tree a distributed checkpoint's manifest holds.
PAYLOAD_FORMAT = "ckptsdk.distributed/1"


def local_file(rank: int) -> str:
    """The file of one rank's own state (RNG states, ``local`` extras) in a checkpoint folder."""
    return f"local-{rank:05d}.safetensors"


def read_payload(tree: Any, *, where: str = "") -> dict[str, Any]:
    """The distributed payload of a manifest tree, checked; CorruptCheckpointError if it is none."""
    payload: dict[str, Any] = codec.decode(tree, {}) if not is_payload(tree) else tree
    if not is_payload(payload):
        raise CorruptCheckpointError(
            f"{where}: not a distributed checkpoint (no {PAYLOAD_FORMAT} payload); open it with "
            "ckptsdk.CheckpointManager instead",
            key=where or None,
        )
    return payload


def is_payload(tree: object) -> bool:
    """Whether a manifest tree is a distributed payload (its ``format`` marker)."""
    return isinstance(tree, dict) and tree.get("format") == PAYLOAD_FORMAT


def file_table(manifest: Manifest) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "digest", "algorithm"}}`` of a manifest's files (what the reader checks)."""
    return {f.name: {"size": f.size, "digest": f.digest, "algorithm": f.algorithm} for f in manifest.files}
