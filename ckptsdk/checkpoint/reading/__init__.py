"""Reading a checkpoint root: its listing and catalog, lineage (who supersedes whom), the
resume point, and the verified read of a checkpoint's tree.

Nothing here writes or deletes; the keep rules it consults are ``ckptsdk.checkpoint.retention``'s.
"""
