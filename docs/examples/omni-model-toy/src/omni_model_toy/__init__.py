"""omni-model-toy: a tiny text-to-image DiT written as a third-party Omni model plugin."""
