"""The ``Qwen2VLProcessor`` of Qwen-Image-Edit folders, loadable where torchvision is missing.

transformers 5 cannot build or load ``Qwen2VLProcessor`` without torchvision: its video processor needs it,
and the processor's class check fails even for ``video_processor=None``. Edit pipelines never pass a video,
so where torchvision is missing the processor is loaded as :class:`ImageOnlyQwen2VLProcessor` (the same
class without the video attribute; images go through the PIL Qwen2-VL image processor, which computes what
the torchvision one computes) and handed to ``from_pretrained`` as the ``processor`` component. Where
torchvision works, this is plain ``Qwen2VLProcessor``.
"""

from __future__ import annotations

import functools
import json
import os

#: what released folders name (model_index.json's ``processor`` entry, processor_config.json)
PROCESSOR_CLASS = "Qwen2VLProcessor"
IMAGE_PROCESSOR_CLASS = "Qwen2VLImageProcessor"


@functools.cache
def has_torchvision() -> bool:
    """Whether torchvision imports (a CUDA wheel next to a CPU torch is installed but fails to import)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or RuntimeError from a mismatched build
        return False
    return True


def image_processor_class() -> type:
    if has_torchvision():
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil


@functools.cache
def processor_class() -> type:
    from transformers import Qwen2VLProcessor

    if has_torchvision():
        return Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """``Qwen2VLProcessor`` without its video processor (the only part that needs torchvision)."""

        @classmethod
        def get_attributes(cls):
            return [a for a in super().get_attributes() if a != "video_processor"]

    return ImageOnlyQwen2VLProcessor


def load_processor(model_path: str):
    """The folder's ``processor`` component, or None when the folder has none."""
    folder = os.path.join(model_path, "processor")
    return processor_class().from_pretrained(folder) if os.path.isdir(folder) else None


def record_as_qwen2vl_processor(model_path: str) -> None:
    """Name the saved processor as released folders do (``transformers`` / ``Qwen2VLProcessor``, image
    processor ``Qwen2VLImageProcessor``), whichever stand-in class saved it."""
    index_path = os.path.join(model_path, "model_index.json")
    _update_json(index_path, lambda d: d.update(processor=["transformers", PROCESSOR_CLASS]))
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = os.path.join(model_path, "processor", name)
        if os.path.isfile(path):
            _update_json(path, _rename_classes)


def _rename_classes(d: dict) -> None:
    if "processor_class" in d:
        d["processor_class"] = PROCESSOR_CLASS
    if "image_processor_type" in d:
        d["image_processor_type"] = IMAGE_PROCESSOR_CLASS
    if isinstance(d.get("image_processor"), dict):
        _rename_classes(d["image_processor"])


def _update_json(path: str, change) -> None:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    change(data)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
