"""What is written: the documents, a root's layout, the manifest, the environment, the state codec, tensor files.

Mostly pure format, bytes in and models out; every JSON document follows ``format.document``'s
one rule. The tensor files are read and written where they lie: ``tensorfile`` (verified reads),
``tensorwriter`` (streamed writes) and ``hashedread`` (the hashing reader under both) do their I/O
through a :class:`~ckptsdk.backends.base.Backend` they are given, and ``readahead`` warms local
files in the page cache; which keys to read or write, when, and under which lease is not theirs.
Nothing here opens a store, takes a lease or runs the save pipeline.
"""
