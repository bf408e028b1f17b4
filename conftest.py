"""Collection switch of the repository's test run (pytest loads this conftest before any other).

``OMNI_PLUGIN_TESTS_DONE=1``, which ``.ci/run`` sets once ``scripts/check_dists.py`` has passed: every plugin's own
tests (``plugins/<kind>/<name>/tests``) have just run against that plugin's wheel installed alone, with only what
it declares -- the stricter of the two runs -- so the main run does not run them a second time. Unset (any local
``pytest -q``), everything is collected.

Under ``pytest -n N --dist loadgroup`` (the README's test command), a test file is one group by default: its module
fixtures (tiny model folders, engines shared by its tests) are built once, on the worker that runs it; a test that
names its own ``xdist_group`` (the combination matrix's compile runs) goes with that group instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
