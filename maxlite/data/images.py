"""Images for vision-language SFT: loading a record's image and preprocessing it for the encoder.

`load_image` takes an image reference as datasets hold it: a path (relative to the data file's
folder), raw bytes, a `{"bytes", "path"}` dict (parquet / HF datasets), a `data:image/...;base64,`
URI or an http(s) URL. It applies the EXIF orientation (as transformers' `load_image` does) and
converts to RGB as the HF image processors do: an image with transparency is composited onto white
(a transparent pixel's colour is arbitrary, often black), anything else is converted directly.

The preprocessing equals the checkpoints' own HF image processors bit for bit (tests/test_images.py
compares against the PIL backends), because it is the same steps on the same types: a Pillow resize
of the uint8 image, a float64 rescale by 1/255 cast to float32, then a float32 normalize.
  qwen_patches  — Qwen2-VL / Qwen2.5-VL / Qwen3-VL (`Qwen2VLImageProcessor`): a resize to a
                  multiple of patch·merge within a pixel budget, then flat patches in merge² groups.
  siglip_pixels — SigLIP / Gemma 3 (`Gemma3ImageProcessor`, without pan-and-scan): a square resize.
  gemma4_patches — Gemma 4 (`Gemma4ImageProcessor`): a resize at the image's own aspect ratio within a
                  patch budget (sides multiples of patch·pool), then flat patches in raster order, each
                  with its (column, row), padded to the budget.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pathlib
import urllib.request
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageOps

from maxlite.config import ConfigError

URL_TIMEOUT_S = 30


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _data_uri_bytes(uri: str, where: str) -> bytes:
    head, sep, payload = uri.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ValueError(f"{where}: image data URI is not of the form data:image/...;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise ValueError(f"{where}: image data URI is not valid base64 ({_one_line(e)})") from None


def _fetch(url: str, where: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_S) as response:
            return response.read()
    except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
        raise ValueError(f"{where}: image {url!r} could not be fetched ({_one_line(e)})") from None


def _read_path(ref: str, base_dir: str | pathlib.Path, where: str) -> bytes:
    path = pathlib.Path(base_dir) / pathlib.Path(ref).expanduser()
    if not path.exists():
        looked = "" if str(path) == ref else f" (looked for {path})"
        raise ValueError(f"{where}: image {ref!r} does not exist{looked}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"{where}: image {ref!r} cannot be read ({e.strerror or _one_line(e)})") from None


def _bytes_of(ref: Any, base_dir: str | pathlib.Path, where: str) -> tuple[bytes, str]:
    """The encoded image and how to name it in an error."""
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return bytes(ref), f"of {len(ref)} bytes"
    if isinstance(ref, dict) and ("bytes" in ref or "path" in ref):
        if ref.get("bytes") is not None:  # HF datasets keep the path beside the bytes only as a name
            data, name = _bytes_of(ref["bytes"], base_dir, where)
            return data, (f"{ref['path']!r} ({name})" if ref.get("path") else name)
        if ref.get("path"):
            return _bytes_of(ref["path"], base_dir, where)
        raise ValueError(f"{where}: image {{'bytes', 'path'}} holds neither bytes nor a path")
    if isinstance(ref, str):
        if ref.startswith("data:"):
            return _data_uri_bytes(ref, where), "data URI"
        if ref.startswith(("http://", "https://")):
            return _fetch(ref, where), repr(ref)
        return _read_path(ref, base_dir, where), repr(ref)
    raise ValueError(f"{where}: image is a {type(ref).__name__}, not a path, URL, data URI, bytes "
                     "or {'bytes': ..., 'path': ...}")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as the HF processors convert (transformers.image_transforms.convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def load_image(ref: Any, *, base_dir: str | pathlib.Path, where: str) -> Image.Image:
    """The RGB image `ref` refers to; `where` names the record in the one-line ValueError."""
    data, name = _bytes_of(ref, base_dir, where)
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # decode now: a truncated file fails here, not later in a worker
            return to_rgb(ImageOps.exif_transpose(image))
    except Exception as e:  # Pillow's decoders raise many types on corrupt data
        reason = "unknown format" if isinstance(e, Image.UnidentifiedImageError) else _one_line(e)
        raise ValueError(f"{where}: image {name} is not a readable image ({reason})") from None


def _rescale_normalize(pixels_HWC: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 → float32 in the HF processors' order and types (rescale in float64, normalize in float32)."""
    x = (pixels_HWC.astype(np.float64) * (1 / 255)).astype(np.float32)
    return (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen-VL's target size: both sides multiples of `factor`, the area within [min_pixels,
    max_pixels], the aspect ratio kept as nearly as rounding allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {width}x{height} pixels: Qwen-VL takes aspect ratios up to 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_patches(image: Image.Image, *, patch_size: int, temporal_patch_size: int, merge_size: int,
                 min_pixels: int, max_pixels: int, mean: Sequence[float], std: Sequence[float],
                 ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Qwen-VL's `pixel_values` [N, C·tp·p·p] float32 and `image_grid_thw` (1, h, w) for one RGB image.

    Rows run over merge groups in raster order and over the merge² patches inside each group, so
    the merger reads each group as merge² consecutive rows. A still image is one temporal patch:
    its frame repeated temporal_patch_size times, as the processors do.
    """
    height, width = smart_resize(image.height, image.width, factor=patch_size * merge_size,
                                 min_pixels=min_pixels, max_pixels=max_pixels)
    resized = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    x_HWC = _rescale_normalize(np.asarray(resized), mean, std)
    grid_h, grid_w = height // patch_size, width // patch_size
    m, p, channels = merge_size, patch_size, x_HWC.shape[-1]
    x = x_HWC.reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # (gh/m, gw/m, m, m, C, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal_patch_size, p, p))
    return x.reshape(grid_h * grid_w, channels * temporal_patch_size * p * p), (1, grid_h, grid_w)


def qwen_tokens(grid_thw: Sequence[int], merge_size: int) -> int:
    """Placeholder tokens for one image in the text: one per merged group of merge² patches."""
    t, h, w = grid_thw
    return t * h * w // merge_size**2


def siglip_pixels(image: Image.Image, *, size: int, mean: Sequence[float], std: Sequence[float],
                  resample: Image.Resampling = Image.Resampling.BILINEAR) -> np.ndarray:
    """SigLIP / Gemma 3's `pixel_values` [C, size, size] float32 for one RGB image (a square resize,
    aspect ratio not kept, as the processor does; bilinear is Gemma 3's resample)."""
    resized = image.resize((size, size), resample=resample)
    return np.ascontiguousarray(_rescale_normalize(np.asarray(resized), mean, std).transpose(2, 0, 1))


def gemma4_size(height: int, width: int, *, patch_size: int, pool_size: int, max_soft_tokens: int,
                where: str) -> tuple[int, int]:
    """Gemma 4's target (height, width): the largest at the image's aspect ratio within
    max_soft_tokens · pool² patches whose sides are multiples of patch·pool; a side that rounds to
    nothing becomes one multiple and the other the aspect ratio's whole multiples, capped
    (transformers' get_aspect_ratio_preserving_size, edge cases and errors included)."""
    max_patches = max_soft_tokens * pool_size**2
    target_px = max_patches * patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side = pool_size * patch_size
    target_h, target_w = math.floor(factor * height / side) * side, math.floor(factor * width / side) * side
    if target_h == 0 and target_w == 0:
        raise ConfigError(f"{where}: an image of {width}x{height} pixels resizes to 0 x 0 within "
                          f"vision_tokens_per_image={max_soft_tokens} soft tokens of {side}x{side} pixels: "
                          f"set vision_tokens_per_image to the processor's max_soft_tokens")
    longest = max_soft_tokens * side
    if target_h == 0:
        target_h, target_w = side, min(width // height * side, longest)
    elif target_w == 0:
        target_h, target_w = min(height // width * side, longest), side
    if target_h * target_w > target_px:
        raise ConfigError(f"{where}: an image of {width}x{height} pixels resizes to {target_w}x{target_h}, more than "
                          f"{max_patches} patches of {patch_size}x{patch_size}")
    return target_h, target_w


def gemma4_positions(grid_h: int, grid_w: int, num_patches: int) -> np.ndarray:
    """Each patch's (column, row) [num_patches, 2] int32, rows of patches in raster order; -1 past
    the grid_h · grid_w real ones (the processor's padding)."""
    rows, cols = np.divmod(np.arange(grid_h * grid_w, dtype=np.int32), grid_w)
    positions = np.full((num_patches, 2), -1, np.int32)
    positions[:grid_h * grid_w] = np.stack([cols, rows], axis=-1)
    return positions


def gemma4_patches(image: Image.Image, *, patch_size: int, pool_size: int, max_soft_tokens: int,
                   mean: Sequence[float], std: Sequence[float], where: str,
                   ) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """Gemma 4's `pixel_values` [Np, p·p·3] float32 and `image_position_ids` [Np, 2] int32 of one RGB
    image, Np = max_soft_tokens · pool² (padding rows: zeros, positions -1), and its patch grid
    (h, w). Each patch's pixels run in (row, column, channel) order. Bicubic is the processor's
    resample; mean 0 / std 1 (Gemma 4's) leave the rescaled pixels as they are, as its do_normalize
    false does."""
    height, width = gemma4_size(image.height, image.width, patch_size=patch_size, pool_size=pool_size,
                                max_soft_tokens=max_soft_tokens, where=where)
    resized = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    x_HWC = _rescale_normalize(np.asarray(resized), mean, std)
    grid_h, grid_w, p, channels = height // patch_size, width // patch_size, patch_size, x_HWC.shape[-1]
    x = x_HWC.reshape(grid_h, p, grid_w, p, channels).transpose(0, 2, 1, 3, 4)  # (gh, gw, p, p, C)
    num_patches = max_soft_tokens * pool_size**2
    patches_NP = np.zeros((num_patches, p * p * channels), np.float32)
    patches_NP[:grid_h * grid_w] = x.reshape(grid_h * grid_w, -1)
    return patches_NP, gemma4_positions(grid_h, grid_w, num_patches), (grid_h, grid_w)
