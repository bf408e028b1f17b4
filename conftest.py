"""Collection switch and test grouping of the repository's test run (pytest loads this conftest before any other).

``OMNI_PLUGIN_TESTS_DONE=1``, which ``.ci/run`` sets once ``scripts/check_dists.py`` has passed: every plugin's own
tests (``plugins/<kind>/<name>/tests``) have just run against that plugin's wheel installed alone, with only what
it declares -- the stricter of the two runs -- so the main run does not run them a second time. Unset (any local
``pytest -q``), everything is collected.

Under ``pytest -n N --dist loadgroup`` (the README's test command) the tests are dealt to the workers one by one,
in collection order, except those that name an ``xdist_group``: a group runs on one worker, so what its tests
share (the combination matrix's runs, computed once per worker in a module fixture) is computed once. Two things
here keep that true:

* pytest-xdist marks a group by appending ``@<group>`` to the test's node id, which pytest >= 9.2 no longer lets
  it do (structured node ids: xdist 3.8 still writes the old ``_nodeid`` attribute and nothing happens,
  pytest-dev/pytest-xdist#1386): every group was silently split test by test, and both workers computed the
  matrix's shared compile runs. :func:`pytest_collection_modifyitems` appends the suffix itself where it is
  missing.
* Groups are dealt in collection order (``loadscopereorder`` off: xdist would otherwise deal the groups with the
  most tests first, whatever their cost), so a test file orders its heaviest group first (the matrix's compile
  runs on two ranks start before its cheap eager runs). Tests without a group count one each either way.

No default group per test file: xdist reads the groups in its own ``pytest_collection_modifyitems``, which runs
before a conftest's, so marks added here were never honoured (one group per file would build each file's module
fixtures once, but deals coarser units; measure the whole run before choosing it).
"""

from __future__ import annotations

import os
import warnings
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


def pytest_configure(config) -> None:
    # the controller deals the groups in collection order (see the module docstring)
    if getattr(config.option, "dist", None) == "loadgroup" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _group_suffix(item) -> str | None:
    """``@<group>`` as pytest-xdist's loadgroup writes it (its names, sorted, joined by ``_``), or None."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "@" + "_".join(sorted(names)) if names else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup
        return
    lost = []
    for item in items:
        suffix = _group_suffix(item)
        if suffix is None or item.nodeid.endswith(suffix):  # no group, or xdist's own suffix took effect
            continue
        nodeid = item.nodeid + suffix
        if hasattr(item, "_id"):  # pytest >= 9.2: the structured node id xdist 3.8 does not update
            item._id = type(item._id).parse(nodeid)
        if item.nodeid != nodeid:
            lost.append(item.nodeid)
    if lost:
        warnings.warn(f"xdist_group not applied to {len(lost)} tests (e.g. {lost[0]}): this pytest's node ids "
                      "changed again; the groups run split test by test", stacklevel=1)
