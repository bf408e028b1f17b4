"""Built-in plugin: the ``omni plugins`` and ``omni env`` subcommands.

Registered through ``omni_register_commands`` like any plugin's command; the handlers live in
``omni_core.cli.plugins`` and ``omni_core.cli.env`` and are imported only when the parser is built.
"""

from omni_core.plugins.hookspecs import hookimpl


@hookimpl
def omni_register_commands(subparsers):
    from omni_core.cli import env, lora, plugins, preview

    plugins.add_parser(subparsers)
    env.add_parser(subparsers)
    lora.add_parser(subparsers)
    preview.add_parser(subparsers)
