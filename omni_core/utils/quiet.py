"""Keep optional libraries' import noise out of Omni's commands and worker processes.

``import diffusers`` imports torchao whenever it is installed (its quantizer registry does), and torchao's import
logs a warning for every prebuilt kernel library that does not load on this machine (``Failed to load
.../_C_mxfp8...so``), torch logs a deprecation for each enum torchao registers with pytree, and diffusers logs
"Unable to import `torchao` Tensor objects" -- on every command, although nothing asked for quantization. None of
it concerns Omni's user: whether a quantization method can run here is probed and reported on its own
(``omni env``, ``ConfigError`` at start-up). So the ``omni`` command and the worker processes raise those
loggers to ERROR; ``omni -v`` (and ``OMNI_LIBRARY_WARNINGS=1``) leave them as they are. A library user's own
process is never changed by importing Omni.
"""

from __future__ import annotations

import logging
import os

#: the loggers of the import-time messages above (errors still show)
NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")


def quiet_optional_libraries() -> None:
    """Raise :data:`NOISY_LOGGERS` to ERROR (before the libraries are imported: their import is the noise)."""
    if os.environ.get("OMNI_LIBRARY_WARNINGS") == "1":
        return
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


__all__ = ["NOISY_LOGGERS", "quiet_optional_libraries"]
