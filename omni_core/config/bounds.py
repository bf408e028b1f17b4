"""Hard bounds every config field is checked within (shared by sampling params, limits and the engine)."""

from __future__ import annotations


DTYPES = ("auto", "float32", "bfloat16", "float16")
OUTPUT_TYPES = ("pil", "pt", "np", "latent")
MAX_OUTPUTS_PER_PROMPT = 16
MAX_INFERENCE_STEPS = 1000
#: guidance scales (guidance_scale, and the ones models declare) must lie in [0, GUIDANCE_MAX]: models
#: are used at 1-20, and a larger scale only amplifies the conditional difference into saturated noise
GUIDANCE_MAX = 100.0
#: hard bounds of one output's height and width, and of num_frames (limits are checked within these)
MAX_SIDE = 16384
MAX_FRAMES = 10000
#: |lora_scale| bound: adapters are used at 0-2; far beyond, the update swamps the base weights
LORA_SCALE_MAX = 10.0
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
