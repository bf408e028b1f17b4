import os
import tempfile


def pytest_configure(config):
    # Omni("toy") builds its folder on first use; keep the tests' copy out of the user's ~/.cache
    os.environ["OMNI_TOY_HOME"] = os.environ.get("OMNI_TOY_HOME") or tempfile.mkdtemp(prefix="omni-toy-")
