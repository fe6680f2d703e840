"""Hypothesis settings profiles for the stateful property tests: ``ci`` (default) and ``deep``.

Registered at import. ``--hypothesis-profile=NAME`` (hypothesis' pytest plugin) loads a profile
before test modules are imported, so for ``deep`` load this module first:
``python -m pytest -p tests.support.hypothesis_profiles --hypothesis-profile=deep --timeout=0``
``tests/stories/test_lineage_invariants.py -n 2``
(or set ``CKPTSDK_HYPOTHESIS_PROFILE=deep``). Only settings live here; no strategies, no tests.

``--timeout=0``: pyproject's 300 s per test cuts the deep Drive machines off (about 30 min for the
four on 2 cores), and hypothesis then reports the cut as a flaky failure.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,
    database=None,  # no example database written into the tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    stateful_step_count=40,
    print_blob=True,
)

# ci: a few hundred schedules over all backend kinds, well under a minute and a half on 2 cores;
# derandomized, so CI explores the same schedules every run (deep explores new ones each time).
settings.register_profile("ci", max_examples=250, derandomize=True, **_COMMON)
# deep: thousands of schedules, for a local run before a release.
settings.register_profile("deep", max_examples=3000, **_COMMON)

PROFILES = ("ci", "deep")


def lineage_settings(scale: float = 1.0) -> settings:
    """The settings for one lineage property test.

    The profile is the one loaded with ``--hypothesis-profile`` if it is ``ci`` or ``deep``, else
    ``$CKPTSDK_HYPOTHESIS_PROFILE``, else ``ci``. ``scale`` shares the profile's example budget
    between the test functions (drive gets the most; the immediately consistent kinds less).
    """
    name = settings.get_current_profile_name()
    if name not in PROFILES:
        name = os.environ.get("CKPTSDK_HYPOTHESIS_PROFILE", "ci")
    base = settings.get_profile(name)
    return settings(base, max_examples=max(1, int(base.max_examples * scale)))
