"""Test helpers shipped with ckptsdk, for testing code that uses it and for backend authors.

- ``FaultyBackend``, ``fail_nth``, ``SimulatedCrash``, ``FailOn``, ``OPS`` (``faulty.py``): wrap
  any backend to fail chosen calls (crash windows) and count calls. No test framework needed.
- ``ckptsdk.testing.counting.CountingBackend``: forwards to a backend and counts the bytes and
  calls each operation sends, so a full copy cannot pass for a cheap one (tests, benchmarks).
- ``ckptsdk.testing.conformance.BackendConformance``: the backend contract as pytest base classes;
  imported from its module (it needs pytest). Nothing in the library itself uses this package.
"""

from __future__ import annotations

from ckptsdk.testing.faulty import OPS, FailOn, FaultyBackend, SimulatedCrash, fail_nth

__all__ = ["FaultyBackend", "SimulatedCrash", "fail_nth", "FailOn", "OPS"]
