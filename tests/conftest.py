"""Test-wide settings. Under CI (CI=true), hypothesis runs derandomized: the same
examples on every run, so a submission cannot pass or fail by the luck of the draw.
Locally the search stays random, which is how new counterexamples are found."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
