"""Doors in and out: import a ``torch.save`` file (the one place that calls ``torch.load``), export weights.

Built on the manager; nothing on the restore path imports this package. Where the doors may
write is guard.py's rule, what an archive may expand to archive_bound.py's, which files the
import may open source.py's, what an HF Trainer folder holds hf_folder.py's, and where a foreign
checkpoint's parts go layout.py's.
"""
