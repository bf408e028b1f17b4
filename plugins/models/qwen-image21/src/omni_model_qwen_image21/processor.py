"""The ``Qwen3VLProcessor`` of Qwen-Image 2.1 folders, loadable where torchvision is missing.

transformers 5 cannot build or load ``Qwen3VLProcessor`` without torchvision: its video processor needs it. The
text-to-image pipeline never passes a video (nor an image), so where torchvision is missing the processor is
loaded as :class:`ImageOnlyQwen3VLProcessor` (the same class without the video attribute, images through the
PIL Qwen2-VL image processor) and handed to ``from_pretrained`` as the ``processor`` component. Where torchvision
works, this is plain ``Qwen3VLProcessor``.
"""

from __future__ import annotations

import functools
import json
import os

#: what released folders name (model_index.json's ``processor`` entry)
PROCESSOR_CLASS = "Qwen3VLProcessor"
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
    from transformers import Qwen3VLProcessor

    if has_torchvision():
        return Qwen3VLProcessor

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        """``Qwen3VLProcessor`` without its video processor (the only part that needs torchvision)."""

        @classmethod
        def get_attributes(cls):
            return [a for a in super().get_attributes() if a != "video_processor"]

    return ImageOnlyQwen3VLProcessor


def load_processor(model_path: str):
    """The folder's ``processor`` component, or None when the folder has none."""
    folder = os.path.join(model_path, "processor")
    return processor_class().from_pretrained(folder) if os.path.isdir(folder) else None


def record_as_qwen3vl_processor(model_path: str) -> None:
    """Name the saved processor as released folders do (``transformers`` / ``Qwen3VLProcessor``), whichever
    stand-in class saved it."""
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
