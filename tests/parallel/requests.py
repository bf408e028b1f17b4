"""The requests the engine-level parallelism tests run (sequence, CFG, data and tensor parallel alike), so each
model's one-process reference is computed once per session and shared (``references``)."""

#: tiny Qwen-Image: VAE factor 4 and 2x2 packing, so a 24x40 image has 3 x 5 = 15 tokens, 32x32 has 16
QWEN_REQUESTS = [
    {"prompt": "a red fox jumping over a lazy dog in the snow", "negative_prompt": "blurry", "true_cfg_scale": 4.0,
     "height": 24, "width": 40, "num_inference_steps": 2, "seed": 1},
    {"prompt": "a cat", "negative_prompt": "low quality, watermark", "true_cfg_scale": 4.0,
     "height": 24, "width": 40, "num_inference_steps": 2, "seed": 2},
    {"prompt": "an astronaut riding a horse", "height": 32, "width": 32, "num_inference_steps": 2, "seed": 3},
]
#: tiny Wan: VAE factors 4 (time) / 8 (space), patch 1x2x2: 9 frames of 16x48 are 3 x 1 x 3 = 9 tokens,
#: 5 frames of 32x32 are 2 x 2 x 2 = 8; three steps cross the two experts' boundary
WAN_REQUESTS = [
    {"prompt": "a red fox in the snow", "negative_prompt": "blurry", "guidance_scale": 4.0, "guidance_scale_2": 3.0,
     "height": 16, "width": 48, "num_frames": 9, "num_inference_steps": 3, "seed": 1},
    {"prompt": "a cat", "guidance_scale": 1.0, "guidance_scale_2": 1.0, "height": 32, "width": 32, "num_frames": 5,
     "num_inference_steps": 3, "seed": 2},
]

#: the trained shapes model (4 heads, patch 4): 28x28 is 7 x 7 = 49 tokens, 32x32 is 64
SHAPES_REQUESTS = [
    {"prompt": "a red circle in the top left", "negative_prompt": "a blue square", "guidance_scale": 4.0,
     "height": 28, "width": 28, "num_inference_steps": 4, "seed": 1},
    {"prompt": "a small green triangle in the bottom right", "negative_prompt": "", "guidance_scale": 4.0,
     "height": 28, "width": 28, "num_inference_steps": 4, "seed": 2},
    {"prompt": "a yellow cross in the center", "guidance_scale": 1.0, "height": 32, "width": 32,
     "num_inference_steps": 4, "seed": 3},
]
