"""Writing checkpoints: the writer's session, opening (the lease and the first listing), the save
pipeline (snapshot, staging, scheduling, pacing, incremental sharing, commit), what follows a
commit, the takeover's anchor, and how a writer ends.

Reads are ``reading``'s; which checkpoints go, ``pruning``'s.
"""
