"""Doors in and out: import a ``torch.save`` file (the one place that calls ``torch.load``), export weights.

Built on the manager; nothing on the restore path imports this package.
"""
