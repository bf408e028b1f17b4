"""``python -m omni_core.cli`` is the ``omni`` command."""

import sys

from omni_core.cli.main import main

sys.exit(main())
