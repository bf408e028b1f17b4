"""Input images of a request: what a model declares it takes, the checks the engine runs, the form they travel in.

Edit and image-to-video models take one or more images with the prompt. A pipeline declares that with an
``ImageInput`` record (``OmniPipeline.image_input``); the engine's process checks every request's images
against it and the ``max_image_pixels`` limit before any work starts (type, mode, size, count, each error
naming the ``image`` field), then turns each image into an RGB ``uint8`` tensor ``[3, H, W]``. Tensors
cross to workers through the same transport as latents (shared memory, or bytes when small), never as
pickled PIL objects; a pipeline rebuilds the exact PIL image with :func:`to_pil` when it hands images to
diffusers' processors (RGB -> uint8 -> RGB is lossless, so parity with diffusers given the same PIL image holds).

Import-light: PIL, numpy and torch are imported only when images are checked or converted. The conversions
run in numpy, never in torch kernels: they run on threads other than the model's (the caller's, the
server's), and a torch op there would give that thread an OpenMP team of its own, slowing the model's
(``omni_core.platforms.threads``).
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.errors import ConfigError

#: PIL modes an input image may have; each converts to RGB as diffusers' image processors do
#: (``Image.convert("RGB")``). 16-bit and float modes are refused: their RGB conversion clips silently.
ACCEPTED_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr", "La")


@attrs.frozen
class ImageInput:
    """A pipeline's declaration that its requests carry input images (``None`` on the class: no images).

    ``min_images`` / ``max_images`` bound how many one request carries (an edit model: 1..1; a multi-image
    edit model: 1..3; an image-to-video model: 1..1). ``size_splits_batch``: requests whose input images differ
    in size cannot share a batch (the condition's token count follows the input size, as in Qwen-Image-Edit);
    False when the model resizes every input to the output size (Wan image-to-video), so the output size,
    already part of the batch key, is enough. ``role`` says what the images are for, in error messages.
    """

    min_images: int = attrs.field(default=1, validator=attrs.validators.ge(0))
    max_images: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    size_splits_batch: bool = True
    role: str = "the image to edit"

    def batch_key(self, images: list[Any]) -> tuple:
        """What of the images must match for two requests to share a wave (the count always does)."""
        if not self.size_splits_batch:
            return (len(images),)
        return (len(images), *(tuple(image_size(im)) for im in images))


def image_size(image: Any) -> tuple[int, int]:
    """``(height, width)`` of a PIL image or a ``[3, H, W]`` tensor."""
    if hasattr(image, "shape"):
        return int(image.shape[-2]), int(image.shape[-1])
    return image.height, image.width


def as_image_list(value: Any, field: str = "image") -> list[Any]:
    """A PIL image, a list of them, or None (-> ``[]``) as a list; anything else is a ``ConfigError``."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for i, item in enumerate(items):
        if not _is_pil(item):
            where = f"{field}[{i}]" if isinstance(value, (list, tuple)) else field
            raise ConfigError(f"{where} must be a PIL image (PIL.Image.Image), got {type(item).__name__}; open a "
                              f"file with PIL.Image.open(path)", field=field)
    return items


def _is_pil(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # no PIL: nothing can be a PIL image
        return False
    return isinstance(value, Image.Image)


def check_images(images: list[Any], spec: ImageInput | None, *, model: str, max_image_pixels: int | None,
                 field: str = "image") -> None:
    """Refuse images a model cannot take, before any work starts; every error names ``field``."""
    if spec is None:
        if images:
            raise ConfigError(f"{model} does not take input images (it generates from the prompt alone); remove "
                              f"{field!r}", field=field)
        return
    n = len(images)
    if n < spec.min_images:
        raise ConfigError(f"{model} needs {spec.role}: give {field!r} with "
                          + (f"{spec.min_images} image" if spec.min_images == spec.max_images == 1
                             else f"{spec.min_images} to {spec.max_images} images") + f" (got {n})", field=field)
    if n > spec.max_images:
        raise ConfigError(f"{model} takes at most {spec.max_images} input image{'s' * (spec.max_images > 1)}, "
                          f"got {n}", field=field)
    for i, image in enumerate(images):
        where = f"{field}[{i}]" if n > 1 else field
        if image.mode not in ACCEPTED_MODES:
            raise ConfigError(f"{where} has mode {image.mode!r}, which {model} cannot take; allowed modes: "
                              f"{', '.join(ACCEPTED_MODES)} (convert it with image.convert('RGB'))", field=field)
        height, width = image.height, image.width
        if height < 1 or width < 1:
            raise ConfigError(f"{where} is empty ({width}x{height})", field=field)
        if max_image_pixels is not None and height * width > max_image_pixels:
            raise ConfigError(f"{where} is {width}x{height} = {height * width} pixels, which exceeds "
                              f"max_image_pixels={max_image_pixels} for {model}; resize it, or raise the limit with "
                              f"limits={{'max_image_pixels': ...}} (omni serve --max-image-pixels)", field=field)


def warmup_images(spec: ImageInput, height: int, width: int) -> list[Any]:
    """The fewest input images ``spec`` accepts (at least one), grey, at the warm-up output size."""
    from PIL import Image

    return [Image.new("RGB", (width, height), (128, 128, 128)) for _ in range(max(1, spec.min_images))]


def to_tensor(image: Any) -> Any:
    """A checked PIL image as an RGB ``uint8`` tensor ``[3, H, W]`` (what travels to workers)."""
    import numpy as np
    import torch

    array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))  # numpy copies: no torch kernel


def to_pil(tensor: Any) -> Any:
    """The PIL image a ``[3, H, W]`` ``uint8`` tensor came from (exact)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.ascontiguousarray(tensor.detach().to("cpu").numpy().transpose(1, 2, 0)))  # HxWx3 RGB


def unit_float_to_pil(tensor: Any) -> Any:
    """``[3, H, W]`` floats in [0, 1] (any float dtype, any device) -> a PIL RGB image: clamped, scaled to 255,
    rounded half to even (as ``torch.round``), in numpy (see the module docstring)."""
    import numpy as np
    from PIL import Image

    array = float32_array(tensor)
    pixels = np.rint(np.clip(array, 0, 1) * np.float32(255)).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(pixels.transpose(1, 2, 0)))


def tensor_to_pil(t: Any) -> Any:
    """A pipeline's output tensor as PIL: ``[3, H, W]`` floats in [0, 1] -> an image; ``[F, 3, H, W]`` -> a list of
    frames. Here rather than in the pipelines so the server converts outputs without importing them."""
    if t.dim() == 4:
        return [unit_float_to_pil(f) for f in t]
    return unit_float_to_pil(t)


def float32_array(tensor: Any) -> Any:
    """A float tensor as a float32 numpy array without a torch kernel: bfloat16 (which numpy lacks) widened by
    its bits (bf16 is the upper half of a float32), other dtypes by numpy."""
    import numpy as np
    import torch

    t = tensor.detach().to("cpu")
    if t.dtype == torch.bfloat16:
        return (t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return t.numpy().astype(np.float32, copy=False)
