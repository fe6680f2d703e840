"""The bytes of tensors: the tensor file (safetensors) read and written through a backend, its
hashed reads and read-ahead, the memory a read may take, and the proof that live tensors hold the
bytes a manifest records (and its background re-hash).

The documents (manifest, layout, digests as rules) are the ``format`` package's; storage the backends'.
"""
