"""The one ``__version__`` of ckptsdk (pyproject's ``version`` is kept equal by tests/project/test_public_api.py).

A module of its own so that the format and run-log layers can name the version that wrote a
document without importing the package root (an upward import).
"""

__version__ = "0.1.0"
