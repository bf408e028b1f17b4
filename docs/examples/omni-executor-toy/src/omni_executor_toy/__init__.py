"""omni-executor-toy: the ``pinned`` executor (docs/plugins/executors.md)."""
