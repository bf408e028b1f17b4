"""omni-model-hunyuan-video15: HunyuanVideo 1.5 text- and image-to-video for Omni (diffusers folders)."""
