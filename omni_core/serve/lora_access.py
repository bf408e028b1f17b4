"""Which LoRA files a server request may name: the operator's, nothing else.

Over HTTP, ``lora`` is either the name of an adapter the engine preloaded (``omni serve --lora NAME=PATH``) or a
path whose real location (symlinks and ``..`` resolved) lies under a directory given at start
(``--lora-dir DIR``; a relative path is looked up under each). Anything else gets one fixed message that neither
echoes the path nor tells whether it exists, so the port is no oracle of the server's file system. The Python API
(``Omni(...)``) is not checked here: its caller owns the machine.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from omni_core.errors import ConfigError
from omni_core.serve.errors import APIError

#: the one answer to every adapter the server does not allow (never the path, never whether it exists)
LORA_REFUSED = ("'lora' must be the name of an adapter this server preloaded (omni serve --lora NAME=PATH) or a "
                "file under a directory the server allows (omni serve --lora-dir DIR); this one is neither")


def lora_refused() -> APIError:
    return APIError(400, LORA_REFUSED, param="lora", code="lora_not_allowed")


def check_lora_dirs(dirs: Iterable[str]) -> tuple[str, ...]:
    """The allowed directories as real paths; a ConfigError naming ``lora_dirs`` for one that is not a folder."""
    out = []
    for d in dirs:
        if not os.path.isdir(d):
            raise ConfigError(f"lora_dirs: {d!r} is not a directory (--lora-dir takes folders of adapter files)",
                              field="lora_dirs")
        out.append(os.path.realpath(d))
    return tuple(out)


def allowed_lora(lora: str, names: Mapping[str, Any], dirs: tuple[str, ...]) -> str:
    """``lora`` as the engine should get it: a preloaded name as is, an allowed path as its real path (so a
    symlink swapped later cannot point elsewhere); anything else raises :func:`lora_refused`."""
    if lora in names:
        return lora
    for d in dirs:
        try:
            real = os.path.realpath(os.path.join(d, lora))
        except (ValueError, OSError):  # a NUL byte, a path too long
            raise lora_refused() from None
        if real != d and os.path.commonpath([real, d]) == d and os.path.exists(real):
            return real
    raise lora_refused()
