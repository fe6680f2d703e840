"""What leaves a checkpoint root, and when: rotation after a commit, ``gc``, the keep decisions of
a judge that is not the writer, Drive's recycle mode, shared files no checkpoint uses, the trash ledger.

Deletes only; the rules that decide are ``ckptsdk.checkpoint.retention``'s, the listing ``reading``'s.
"""
