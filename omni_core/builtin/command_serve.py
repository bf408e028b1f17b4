"""Built-in plugin: the ``omni serve`` subcommand."""

from omni_core.plugins.hookspecs import hookimpl


@hookimpl
def omni_register_commands(subparsers):
    from omni_core.cli import serve

    serve.add_parser(subparsers)
