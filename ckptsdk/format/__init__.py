"""What is written: the documents, the layout of a root, the manifest, the state codec, tensor files.

Pure format: bytes in, models out. Nothing here touches storage (backends), leases or the save
pipeline; every JSON document follows ``format.document``'s one rule.
"""
