"""The child process of :func:`omni_core.optimize.device_probe.device_facts`: asks the device itself (it may
create a context: it exits right after) and prints one JSON line,
``{"free_bytes": int, "methods": {method: [usable, reason]}}``.

``python -m omni_core.optimize.probe_child DEVICE_TYPE [INDEX]``
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main(argv: list[str]) -> int:
    from omni_core.optimize.device_probe import CHILD_ENV, free_bytes_here

    os.environ[CHILD_ENV] = "1"  # method_status probes here, never in yet another child
    device_type, index = argv[0], int(argv[1]) if len(argv) > 1 else 0
    from omni_core.optimize.quantize import METHODS, method_status

    facts: dict[str, Any] = {"methods": {m: list(method_status(m, device_type)) for m in METHODS}}
    try:
        facts["free_bytes"] = free_bytes_here(device_type, index)
    except Exception as exc:  # noqa: BLE001 - unknown free memory is 0, as in the engine
        facts["free_bytes"], facts["free_error"] = 0, f"{type(exc).__name__}: {exc}"
    print(json.dumps(facts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
