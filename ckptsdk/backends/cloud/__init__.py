"""Object-store backends (GCS, S3) and what they share: the ``bucket/prefix`` root, ranged reads,
each store's transport and upload payloads.

The contract they meet is ``ckptsdk.backends.base``'s; local disk, Drive and memory live beside it.
"""
