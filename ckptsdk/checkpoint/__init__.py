"""Checkpoints under one root: catalog, lineage, saving, scheduling, staging, deferral, reading, rotation, retention,
usage, shutdown.

Built on the format, lease and run-log layers; the user-facing facade is ``ckptsdk.manager``.
"""
