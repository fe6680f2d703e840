"""What a save may put in a manifest: the limits every reader enforces, checked before a save writes.

A reader refuses a manifest over ``MANIFEST_BYTES`` and JSON nested deeper than pydantic
validates (about 250 levels), and falls back to an earlier checkpoint: so what ``save()`` would
commit beyond them is refused when it is asked for, never committed unreadable. The shares are
one rule each: the state skeleton (``TREE_BYTES``; template.py checks it), the user's fields
(metrics, extra, tags: ``USER_BYTES``; userfield.py), the rest (file entries, the environment)
bounded by the tensor count. Read at call time, so a test may lower them.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JSON_DEPTH", "MANIFEST_BYTES", "TREE_BYTES", "USER_BYTES", "json_depth", "json_size"]

#: ``Manifest.MAX_BYTES``: what a reader parses at most.
MANIFEST_BYTES = 64 << 20
#: The state skeleton's share of a manifest, as JSON bytes.
TREE_BYTES = 48 << 20
#: The share of metrics, extra and tags together, as JSON bytes (a job's few numbers and names).
USER_BYTES = 4 << 20
#: How deep JSON containers in a manifest's tree or extra may nest: pydantic refuses about 254
#: levels when it validates a ``JsonValue``, and they sit a few levels inside the manifest.
JSON_DEPTH = 200


def json_size(value: Any) -> int:
    """Bytes of ``value`` as the manifest writes it (strict JSON, ASCII escapes, no spaces)."""
    return len(json.dumps(value, allow_nan=False, separators=(",", ":")))


def json_depth(value: Any) -> int:
    """How many JSON containers nest at the deepest point of ``value`` (a scalar: 0).

    Iterative, so a value too deep for the recursion limit is measured, not crashed on.

    Example:
        >>> json_depth({"a": [1, {"b": 2}]})
        3
    """
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        level += 1
        deepest = max(deepest, level)
        stack.extend((child, level) for child in children)
    return deepest
