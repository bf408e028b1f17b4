"""Input images sent over HTTP (``/v1/images/edits`` uploads, ``/v1/videos`` ``input_reference``, data URLs in
chat messages): decoded into PIL images with a 400 naming the field for anything that is not a readable image.

The header is read before the pixels: a file whose declared size exceeds ``max_image_pixels`` is refused
before it is decoded (a small PNG can declare a huge canvas), and PIL's own decompression-bomb check is a
second guard. The engine then checks the images against the model (count, mode, size) as for the Python API.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

from omni_core.serve.errors import APIError, invalid

#: formats accepted for input images (what PIL reads safely and clients send)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF")
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


def read_image(data: Any, field: str, max_pixels: int | None) -> Any:
    """An uploaded file's bytes as a PIL image (decoded now, so a truncated file fails here, not in the engine)."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray)):
        raise invalid(f"'{field}' must be an image file (a multipart file part), got a text field", field,
                      code="invalid_image")
    if not data:
        raise invalid(f"'{field}' is an empty file", field, code="invalid_image")
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise invalid(f"'{field}' is not an image file PIL can read; send one of "
                      f"{', '.join(IMAGE_FORMATS)}", field, code="invalid_image") from None
    except Image.DecompressionBombError as exc:
        raise invalid(f"'{field}' is refused: {exc}", field, code="image_too_large") from None
    if image.format not in IMAGE_FORMATS:
        raise invalid(f"'{field}' is a {image.format} image; send one of {', '.join(IMAGE_FORMATS)}", field,
                      code="invalid_image")
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise invalid(f"'{field}' is {width}x{height} = {width * height} pixels, which exceeds max_image_pixels="
                      f"{max_pixels}; send a smaller image (omni serve --max-image-pixels raises the limit)", field,
                      code="image_too_large")
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise invalid(f"'{field}' is refused: {exc}", field, code="image_too_large") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise invalid(f"'{field}' could not be decoded ({exc}); the file may be truncated", field,
                      code="invalid_image") from None
    if getattr(image, "n_frames", 1) > 1:
        image.seek(0)  # an animated GIF/WebP: its first frame
    return image


def read_data_url(url: Any, field: str, max_pixels: int | None) -> Any:
    """A ``data:image/...;base64,...`` URL as a PIL image. Remote URLs are refused: the server fetches nothing."""
    if not isinstance(url, str):
        raise invalid(f"'{field}' must be a data URL string, got {type(url).__name__}", field, code="invalid_image")
    match = _DATA_URL.match(url)
    if match is None:
        shown = url if len(url) <= 40 else url[:37] + "..."
        raise invalid(f"'{field}' must be a base64 data URL (data:image/png;base64,...); this server does not fetch "
                      f"remote URLs, got {shown!r}", field, code="invalid_image")
    if not match.group("b64"):
        raise invalid(f"'{field}' must be base64-encoded (data:image/png;base64,...)", field, code="invalid_image")
    try:
        data = base64.b64decode(url[match.end():], validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"'{field}' has invalid base64 data", field, code="invalid_image") from None
    return read_image(data, field, max_pixels)


def check_count(images: list, field: str, image_input: Any, model: str) -> None:
    """A 400 naming ``field`` when the served model takes no images, or not this many (before decoding more)."""
    if image_input is None:
        if images:
            raise invalid(f"model {model!r} does not take input images; remove '{field}'", field,
                          code="unsupported_parameter")
        return
    n = len(images)
    if not image_input.min_images <= n <= image_input.max_images:
        want = (f"{image_input.min_images}" if image_input.min_images == image_input.max_images
                else f"{image_input.min_images} to {image_input.max_images}")
        raise invalid(f"model {model!r} takes {want} input image(s) in '{field}', got {n}", field,
                      code="invalid_image_count")


__all__ = ["APIError", "IMAGE_FORMATS", "check_count", "read_data_url", "read_image"]
