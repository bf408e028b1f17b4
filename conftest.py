"""Collection switch of the repository's test run (pytest loads this conftest before any other).

``OMNI_PLUGIN_TESTS_DONE=1``, which ``.ci/run`` sets once ``scripts/check_dists.py`` has passed: every plugin's own
tests (``plugins/<kind>/<name>/tests``) have just run against that plugin's wheel installed alone, with only what
it declares -- the stricter of the two runs -- so the main run does not run them a second time. Unset (any local
``pytest -q``), everything is collected.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if os.environ.get("OMNI_PLUGIN_TESTS_DONE") != "1":
        return None
    try:
        parts = collection_path.resolve().relative_to(ROOT).parts
    except ValueError:
        return None
    if len(parts) >= 4 and parts[0] == "plugins" and parts[3] == "tests":
        return True
    return None
