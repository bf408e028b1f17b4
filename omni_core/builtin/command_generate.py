"""Built-in plugin: the ``omni generate`` subcommand."""

from omni_core.plugins.hookspecs import hookimpl


@hookimpl
def omni_register_commands(subparsers):
    from omni_core.cli import generate

    generate.add_parser(subparsers)
