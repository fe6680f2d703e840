"""Checkpoints under one root, in three rooms by concern, over the keep rules they share.

- ``retention``: the keep rules (a pure function from committed manifests to what stays; public
  as :mod:`ckptsdk.keep`).
- ``reading/``: the root's listing and catalog, lineage, the resume point, verified reads.
- ``pruning/``: what leaves the root: rotation, gc, recycling, loose shared files, the trash ledger.
- ``writing/``: the writer's session, opening, the save pipeline, what follows a commit, the
  takeover's anchor, how a writer ends.

Each room imports only the ones listed before it (``TYPE_CHECKING`` aside). Built on the format,
lease and run-log layers; the user-facing facade is ``ckptsdk.manager``.
"""
