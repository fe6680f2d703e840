"""Checkpoints under one root: the catalog, the save pipeline, staging, reading, rotation, retention, usage.

Built on the format, lease and run-log layers; the user-facing facade is ``ckptsdk.manager``.
"""
