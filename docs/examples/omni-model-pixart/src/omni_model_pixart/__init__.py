"""omni-model-pixart: diffusers' PixArt-Sigma as a native, step-wise Omni model plugin (a worked example)."""
