"""TOY_ATTN: attention written out in plain torch, as an example Omni plugin."""
