"""What is written: the documents, a root's layout, the manifest, the environment, the state codec, tensor files.

Pure format: bytes in, models out. Nothing here touches storage (backends), leases or the save
pipeline; every JSON document follows ``format.document``'s one rule.
"""
