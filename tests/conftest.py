"""Settings for every test directory."""

import os

from hypothesis import settings

# testcontainers' reaper (Ryuk) is an image from Docker Hub, which this project never pulls (images are built
# locally, no registry): every Docker-backed test removes its own containers. Set before testcontainers reads it.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

# The property and fuzz tests (tests/unit/test_fuzz.py, tests/unit/jobs, tests/unit/rendezvous) draw new
# inputs on every run where people work, which is how they find new bugs; under CI=true they draw the same
# inputs each time, so that a red CI run is a change in the code, never a new draw (a failure prints its
# reproducer either way).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")
