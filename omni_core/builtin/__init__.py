"""Built-in plugins of the core, registered through the same hooks as entry-point plugins."""
