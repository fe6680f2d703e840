"""The verified data cache: artifacts fetched once (local copy, cache, sources), downloads, archives.

Independent of checkpoints and leases; a dataset's tensor hash is checked by its adapter.
"""
