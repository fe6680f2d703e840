"""Every key of a checkpoint root, and the writer rank its names carry: the one home of both.

A folder ``step-0000005700.e2[.tag]``, a record ``lineage/epoch-000002[.tag].json`` and a shared
tensor file ``shared/0000005700.e2[.tag].<content>.safetensors`` are formatted and parsed here and
nowhere else, as are the writer tag and the order of writer ranks.
What a root's objects mean (committed, orphaned, restorable) is the catalog's; the lease record
itself is :mod:`ckptsdk.lease.record`'s.
"""

from __future__ import annotations

import functools
import re

__all__ = [
    "CKPT_PREFIX",
    "LINEAGE_PREFIX",
    "MANIFEST",
    "SHARED_PREFIX",
    "TAG_DIGITS",
    "TENSORS",
    "Rank",
    "checkpoint_dir",
    "folder_rank",
    "lineage_key",
    "lineage_rank",
    "outranks",
    "parse_folder",
    "shared_key",
    "shared_key_for",
    "shared_rank",
    "writer_tag",
]

CKPT_PREFIX = "step-"
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
LINEAGE_PREFIX = "lineage/"
#: Tensor files several checkpoints refer to (tensors unchanged between saves), named by the
#: step that wrote them, the writer and their content: immutable, never rewritten.
SHARED_PREFIX = "shared/"

#: Hex digits of the lease nonce that make a writer's tag (and order writers of one epoch).
TAG_DIGITS = 8

_TAG = f"[0-9a-f]{{{TAG_DIGITS}}}"
_DIR_RE = re.compile(rf"^step-(\d{{10,}})\.e(\d+)(?:\.({_TAG}))?$")
_LINEAGE_RE = re.compile(rf"^lineage/epoch-(\d+)(?:\.({_TAG}))?\.json$")
_SHARED_RE = re.compile(rf"^shared/(\d{{10,}})\.e(\d+)(?:\.({_TAG}))?\.([0-9a-f]{{16}})\.safetensors$")

# A writer's rank: its lease epoch, then its tag. On stores with compare-and-swap every epoch
# has one writer and the tag is "". Where exclusion is only advisory (Drive), two VMs can both
# believe they took the same epoch; the tag (the first TAG_DIGITS hex digits of the lease nonce)
# keeps their names apart and orders them: the lower rank is superseded, exactly like a lower epoch.
Rank = tuple[int, str]


def writer_tag(nonce: str, *, compare_and_swap: bool) -> str:
    """The tag a writer carries in its names: empty where compare-and-swap makes every epoch
    exclusive, else the first ``TAG_DIGITS`` hex digits of its lease nonce (see ``Rank``)."""
    return "" if compare_and_swap else nonce[:TAG_DIGITS]


def outranks(seen: Rank, mine: Rank) -> bool:
    """Whether the writer ``seen`` supersedes the writer ``mine``: the one fencing comparison.

    A higher epoch wins; within one epoch (two Drive VMs that both believed they took it) the
    higher tag wins. Equal ranks are the same writer.
    """
    return seen > mine


def checkpoint_dir(step: int, epoch: int, tag: str = "") -> str:
    """The folder of one checkpoint: unique per (step, writer), so two writers never collide."""
    return f"step-{step:010d}.e{epoch}" + (f".{tag}" if tag else "")


@functools.lru_cache(maxsize=1 << 14)
def parse_folder(folder: str) -> tuple[int, Rank] | None:
    """(step, writer rank) of a checkpoint folder's name, or None if ``folder`` is not one."""
    # Memoised (a pure function of the name, an immutable result): a root's listing, outline and
    # catalog ask it for each folder several times, 13,000 regex matches at 1,000 checkpoints.
    m = _DIR_RE.match(folder)
    return None if m is None else (int(m.group(1)), (int(m.group(2)), m.group(3) or ""))


def folder_rank(key: str) -> tuple[int, Rank] | None:
    """(step, writer rank) of the checkpoint folder ``key`` lies in, or None if it is not in one."""
    return parse_folder(key.partition("/")[0])


def lineage_key(epoch: int, tag: str = "") -> str:
    """Where the takeover record of the writer (``epoch``, ``tag``) lives."""
    return f"lineage/epoch-{epoch:06d}" + (f".{tag}" if tag else "") + ".json"


def lineage_rank(key: str) -> Rank | None:
    """The writer rank a lineage record's key names, or None if ``key`` is not one."""
    m = _LINEAGE_RE.match(key)
    return None if m is None else (int(m.group(1)), m.group(2) or "")


def shared_key(step: int, epoch: int, tag: str, content: str) -> str:
    """Where the writer (``epoch``, ``tag``) keeps the shared tensors it wrote at ``step``;
    ``content``: 16 hex digits of the tensors' digests (see ``checkpoint.sharing``)."""
    return f"{SHARED_PREFIX}{step:010d}.e{epoch}" + (f".{tag}" if tag else "") + f".{content}.safetensors"


def shared_key_for(key: str, epoch: int, tag: str) -> str | None:
    """The shared file ``key`` (same step and content) under the writer (``epoch``, ``tag``), or
    None if ``key`` is not a shared file's.

    Example:
        >>> shared_key_for("shared/0000000005.e2.0123456789abcdef.safetensors", 3, "a1b2c3d4")
        'shared/0000000005.e3.a1b2c3d4.0123456789abcdef.safetensors'
    """
    m = _SHARED_RE.match(key)
    return None if m is None else shared_key(int(m.group(1)), epoch, tag, m.group(4))


def shared_rank(key: str) -> tuple[int, Rank] | None:
    """(step, writer rank) of a shared tensor file's key, or None if ``key`` is not one."""
    m = _SHARED_RE.match(key)
    return None if m is None else (int(m.group(1)), (int(m.group(2)), m.group(3) or ""))
