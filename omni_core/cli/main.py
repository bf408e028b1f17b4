"""Entry point of the ``omni`` console script.

``main`` builds an ``argparse`` parser whose subcommands all come from the ``omni_register_commands`` hook:
the core's own (``plugins``, ``env``; see :mod:`omni_core.builtin.commands`) and any plugin's, through the
same path. Adding a built-in command is one module with a hookimpl listed in ``BUILTIN_PLUGINS``. Each
command's handler receives the parsed namespace and returns an exit code. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

from omni_core.errors import OmniError

logger = logging.getLogger("omni_core.cli")


class _StderrHandler(logging.Handler):
    """Writes ``omni: warning: ...`` lines to whatever ``sys.stderr`` is at the time (pytest swaps it)."""

    _omni_cli = True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(f"omni: {record.levelname.lower()}: {record.getMessage()}\n")
        except Exception:  # noqa: BLE001
            self.handleError(record)


def _setup_logging(level: int = logging.WARNING) -> None:
    log = logging.getLogger("omni_core")
    if not any(getattr(h, "_omni_cli", False) for h in log.handlers):
        log.addHandler(_StderrHandler())
    log.setLevel(level)


def register_commands(pm, subparsers: argparse._SubParsersAction) -> None:
    """Call every plugin's ``omni_register_commands`` in registration order (built-ins first), each in isolation
    (:meth:`~omni_core.plugins.manager.OmniPluginManager.call_each`: a broken one is listed as failed)."""
    pm.call_each("omni_register_commands", registration_order=True, subparsers=subparsers)


def build_parser(pm=None) -> argparse.ArgumentParser:
    """The ``omni`` parser with every registered subcommand."""
    from omni_core import __version__
    from omni_core.plugins.manager import get_plugin_manager

    pm = pm or get_plugin_manager()
    parser = argparse.ArgumentParser(
        prog="omni", description="Omni: a plugin-driven inference engine for diffusion models.",
        epilog="Environment: OMNI_PLUGINS, OMNI_DISABLE_PLUGINS, OMNI_STRICT_PLUGINS=1, OMNI_NO_PLUGINS=1, "
               "OMNI_PLATFORM, OMNI_ATTENTION_BACKEND.")
    parser.add_argument("--version", action="version", version=f"omni {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages (plugin tracebacks)")
    parser.set_defaults(func=None, _parser=parser)
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    register_commands(pm, subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``omni`` command; returns the exit code (0 ok, 1 error, 2 usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "-v" in argv or "--verbose" in argv
    _setup_logging(logging.DEBUG if verbose else logging.WARNING)
    if verbose:
        os.environ.setdefault("OMNI_LIBRARY_WARNINGS", "1")  # worker processes keep the libraries' warnings too
    else:
        from omni_core.utils.quiet import quiet_optional_libraries

        quiet_optional_libraries()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.func is None:
            parser.print_help()
            return 0
        return int(args.func(args) or 0)
    except OmniError as exc:
        print(f"omni: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `omni plugins list | head -1`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
