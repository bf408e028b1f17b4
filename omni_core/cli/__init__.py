"""The ``omni`` command line. Subcommands come from the ``omni_register_commands`` hook (built-ins included)."""
