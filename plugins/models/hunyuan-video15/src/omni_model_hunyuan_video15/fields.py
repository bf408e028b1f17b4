"""Shape rules and defaults read from a HunyuanVideo 1.5 folder's JSON configs. Imports nothing heavy (the engine
process calls these before any worker loads torch)."""

from __future__ import annotations

import os

from omni_core.pipelines.shape_check import folder_config
from omni_core.pipelines.diffusers_folder import read_json

#: the released VAE (16x spatial, 4x temporal) and patch size 1
DEFAULT_RULES = (16, 16, 4, 16)


def size_rules(model_path: str | None) -> tuple[int, int, int, int]:
    """(height multiple, width multiple, temporal VAE factor, spatial VAE factor) of the folder: the VAE's
    ``spatial_compression_ratio`` x the transformer's ``patch_size``, and its ``temporal_compression_ratio``."""
    vae = folder_config(model_path, "vae") or {}
    tr = folder_config(model_path, "transformer") or {}
    spatial = vae.get("spatial_compression_ratio") or DEFAULT_RULES[3]
    temporal = vae.get("temporal_compression_ratio") or DEFAULT_RULES[2]
    patch = tr.get("patch_size") or 1
    return spatial * patch, spatial * patch, temporal, spatial


def shape_rules(model_path: str | None) -> tuple[int, int, int]:
    """The record's ``size_rules``: (height multiple, width multiple, frame multiple)."""
    return size_rules(model_path)[:3]


def guider_config(model_path: str | None) -> dict:
    """The folder's ``guider/guider_config.json`` (diffusers' ``ClassifierFreeGuidance``), or {}."""
    if not model_path:
        return {}
    return read_json(os.path.join(model_path, "guider", "guider_config.json")) or {}


def target_size(model_path: str | None) -> int:
    """The transformer's ``target_size`` (480p: 640, 720p: 960): the pixel budget of the default size buckets."""
    return (folder_config(model_path, "transformer") or {}).get("target_size") or 640


# Port of diffusers' ``hunyuan_video1_5/image_processor.py`` bucket math (itself copied from Tencent's
# ``hyvideo/utils/data_utils.py``), in plain Python so the engine process can fill the default size without
# importing diffusers/numpy; ``tests/test_fields.py`` checks it equals diffusers' function.
def crop_size_list(base_size: int, patch_size: int, max_ratio: float = 4.0) -> list[tuple[int, int]]:
    """diffusers' ``generate_crop_size_list``: (width, height) buckets of about ``base_size**2`` pixels."""
    num_patches = round((base_size / patch_size) ** 2)
    out, wp, hp = [], num_patches, 1
    while wp > 0:
        if max(wp, hp) / min(wp, hp) <= max_ratio:
            out.append((wp * patch_size, hp * patch_size))
        if (hp + 1) * wp <= num_patches:
            hp += 1
        else:
            wp -= 1
    return out


def bucket_size(height: float, width: float, target: int, spatial: int) -> tuple[int, int]:
    """diffusers' ``HunyuanVideo15ImageProcessor.calculate_default_height_width``: the bucket closest to
    ``height / width`` (never crossing to the other orientation) -> (height, width)."""
    buckets = crop_size_list(target, spatial)
    ratios = [round(float(h) / float(w), 5) for h, w in buckets]
    aspect = float(height) / float(width)
    diffs = [r - aspect for r in ratios]
    indices = [(i, d) for i, d in enumerate(diffs) if (d <= 0 if aspect >= 1 else d >= 0)]
    best = min(indices, key=lambda pair: abs(pair[1]))[0]
    h, w = buckets[best]  # diffusers unpacks the (w, h) bucket as (height, width)
    return h, w
