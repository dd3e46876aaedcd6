"""Images in token rows: a prompt's (or a conversation's) image placeholders expanded to the encoder's
tokens, its multimodal positions, and the image arrays a batch row carries beside its tokens — one
rule for SFT data (data/vision_sft.py) and for `generate --image`.

A chat template writes ONE placeholder token per image (Qwen's `<|image_pad|>` between
`<|vision_start|>` and `<|vision_end|>`); here each becomes as many as the encoder makes for that image
(qwen_vit: the image's patches / merge², set by its size within the pixel budget), never counted by
hand. A document whose placeholders and images differ in number is refused, naming the record.

The image arrays of one document (the qwen_vit kind's, maxlite/models/vision/towers.py): its images'
patch rows [Np, C·tp·p·p] (Np: all its patches), and per patch its image's number within the document
(1, 2, ...), the 2-D RoPE position, and the learned-position interpolation's indices and weights.
Packed rows concatenate documents' patches like their tokens (grain's packing, every patch array
its own length `max_image_patches`); `relabel` numbers the images of a row apart.

The siglip kind (Gemma 3) expands in the TEXT, as Gemma3Processor does: each `<start_of_image>` the
template (or the prompt) writes becomes "\n\n<start_of_image>" + `<image_soft_token>` × mm_tokens_per_image
+ "<end_of_image>\n\n" before tokenization (`text_expansion`, which data/chat.py and generate apply),
so the newlines merge with their neighbours as transformers' tokenization merges them. A document's
images are then [I, C, S, S] (each resized to vision_image_size), packed up to `max_images_per_row`
per row; positions stay plain.

The gemma4_vit kind (Gemma 4) expands in the token ids, as Gemma4Processor's replace_image_token does:
the k-th image placeholder (image_token_id) becomes boi, image × image k's soft tokens (its patches /
pool², set by its aspect ratio within the vision_tokens_per_image budget), eoi. A document's images
are [I, Np, p·p·3] patches and [I, Np, 2] (column, row) positions, every image padded to
Np = vision_tokens_per_image · vision_pool_size² (positions -1), packed up to `max_images_per_row`
per row as siglip's; positions stay plain.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from maxlite.config import ConfigError

PATCH_KEYS = ("image_pixels", "image_segment", "image_rope_hw", "image_pos_index", "image_pos_weight")


def image_refs(messages: Sequence[dict]) -> list[Any]:
    """The images of a conversation, in order (content items {"type": "image", "image": ref})."""
    return [item.get("image") for m in messages if isinstance(m.get("content"), list)
            for item in m["content"] if item.get("type") == "image"]


def placeholders(ids: np.ndarray, token_id: int, num_images: int, where: str) -> np.ndarray:
    """Where the placeholders of a document's `num_images` images are; one per image, else refused."""
    at = np.flatnonzero(ids == token_id)
    if len(at) != num_images:
        raise ConfigError(f"{where}: {num_images} image(s) but {len(at)} image placeholder(s) in the rendered "
                          f"text: each image needs its own placeholder (the chat template writes one per image item)")
    return at


def expand(ids: np.ndarray, mask: np.ndarray, counts: Sequence[int], token_id: int, where: str):
    """(ids, mask) with the k-th placeholder repeated counts[k] times (never supervised)."""
    at = placeholders(ids, token_id, len(counts), where)
    reps = np.ones(len(ids), np.int64)
    reps[at] = counts
    return np.repeat(ids, reps), np.repeat(mask, reps) & (np.repeat(ids, reps) != token_id)


# what a plain (not chat) prompt writes per image, before its expansion: the config's token ids
MARKS = ("vision_start_token_id", "image_token_id", "vision_end_token_id")


class QwenImages:
    """The qwen_vit kind's side of a document: pixels and their layout, token counts, positions."""

    ROW_KEYS = PATCH_KEYS
    PROMPT_MARKS = MARKS
    PAD_VALUES: dict[str, int] = {}  # an array's fill where a prompt batch pads it (0 unless named)

    def __init__(self, cfg):
        from maxlite.models.vision.towers import qwen_spec

        self.cfg, self.spec = cfg, qwen_spec(cfg)
        self.ROW_MULTIPLE = cfg.vision_merge_size ** 2  # a prompt batch's patches: whole merge groups

    def encode(self, images: Sequence[Any]) -> tuple[list[tuple[int, int, int]], dict[str, np.ndarray]]:
        """(each image's patch grid (t, h, w), the document's patch arrays: PATCH_KEYS) of PIL images."""
        from maxlite.data.images import qwen_patches
        from maxlite.models.vision.qwen_vit import patch_layout

        cfg, rows, grids = self.cfg, [], []
        for image in images:
            pixels, grid = qwen_patches(image, patch_size=cfg.vision_patch_size,
                                        temporal_patch_size=cfg.vision_temporal_patch_size,
                                        merge_size=cfg.vision_merge_size, min_pixels=cfg.image_min_pixels,
                                        max_pixels=cfg.image_max_pixels, mean=cfg.image_mean, std=cfg.image_std)
            rows.append(pixels)
            grids.append(tuple(int(g) for g in grid))
        n = sum(len(r) for r in rows)
        width = cfg.vision_temporal_patch_size * cfg.vision_patch_size ** 2 * 3
        layout = patch_layout(grids, self.spec, n) if n else _empty_layout()
        out = {"image_pixels": np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, width), np.float32)}
        out.update({f"image_{k}": np.asarray(v) for k, v in layout.items()})
        return grids, out

    def tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.cfg.vision_merge_size ** 2

    def positions(self, ids: np.ndarray, grids) -> np.ndarray:
        from maxlite.models.vision.positions import mrope_positions

        return mrope_positions(ids, grids, self.cfg.vision_merge_size, self.cfg.image_token_id)

    def doc(self, ids: np.ndarray, mask: np.ndarray, images: Sequence[Any], where: str):
        grids, arrays = self.encode(images)
        ids, mask = expand(ids, mask, [self.tokens(g) for g in grids], self.cfg.image_token_id, where)
        return ids, mask, self.positions(ids, grids), arrays

    SYNTHETIC_GRID = (1, 4, 4)

    def synthetic_markers(self) -> list[int]:
        """A synthetic row's image (dataset_type=synthetic): its markers and placeholders."""
        cfg = self.cfg
        return [cfg.vision_start_token_id, *[cfg.image_token_id] * self.tokens(self.SYNTHETIC_GRID),
                cfg.vision_end_token_id]

    def synthetic(self, row: np.ndarray, rng) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(the row's [T, 3] positions, its random image's patch arrays)."""
        from maxlite.models.vision.qwen_vit import patch_layout

        cfg, grid = self.cfg, self.SYNTHETIC_GRID
        n = grid[1] * grid[2]
        width = 3 * cfg.vision_temporal_patch_size * cfg.vision_patch_size ** 2
        arrays = {"image_pixels": rng.standard_normal((n, width)).astype(np.float32)}
        arrays.update({f"image_{k}": np.asarray(v) for k, v in patch_layout([grid], self.spec, n).items()})
        return self.positions(row, [grid]), arrays

    def row_capacity(self, arrays: dict) -> str | None:
        n = len(arrays["image_pixels"])
        if n > self.cfg.max_image_patches:
            return f"its images have {n} patches, more than a row holds (max_image_patches={self.cfg.max_image_patches})"
        return None

    def pack_lengths(self, length: int) -> dict[str, int]:
        return {"rope": length, **{k: self.cfg.max_image_patches for k in PATCH_KEYS}}

    def batch_shapes(self, B: int, T: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """{key: (shape, dtype)} of what `finish` puts in a batch of B packed rows of T tokens beside the
        text arrays (the planner's abstract batch)."""
        N, width = self.cfg.max_image_patches, 3 * self.cfg.vision_temporal_patch_size * self.cfg.vision_patch_size ** 2
        return {"positions": ((B, T, 3), "int32"), "image_pixels": ((B, N, width), "float32"),
                "image_segment": ((B, N), "int32"), "image_rope_hw": ((B, N, 2), "int32"),
                "image_pos_index": ((B, N, 4), "int32"), "image_pos_weight": ((B, N, 4), "float32")}

    def finish(self, row: dict, out: dict) -> None:
        out["positions"] = row["rope"].astype(np.int32)
        out.update({k: row[k] for k in PATCH_KEYS})
        out["image_segment"] = relabel(row["image_pixels_segment_ids"], row["image_segment"])


def _empty_layout() -> dict[str, np.ndarray]:
    return {"segment": np.zeros(0, np.int32), "rope_hw": np.zeros((0, 2), np.int32),
            "pos_index": np.zeros((0, 4), np.int32), "pos_weight": np.zeros((0, 4), np.float32)}


def relabel(doc_segment: np.ndarray, image_segment: np.ndarray) -> np.ndarray:
    """A packed row's image numbers, unique across its documents (0: padding): documents number
    their images from 1 each, so (document, image) pairs are renumbered in order."""
    key = doc_segment.astype(np.int64) * 65536 + image_segment
    real = image_segment > 0
    new = np.concatenate([[True], key[1:] != key[:-1]]) & real
    return np.where(real, np.cumsum(new), 0).astype(np.int32)


def doc_arrays(kind, ids: np.ndarray, mask: np.ndarray, images: Sequence[Any], where: str):
    """One document's token ids, loss mask, positions ([T, 3]; None where they are plain) and image arrays."""
    return kind.doc(ids, mask, images, where)


class WholeImages:
    """A kind whose row holds whole images, up to `max_images_per_row` (siglip, gemma4_vit): each of
    its ROW_KEYS arrays has one entry per image."""

    ROW_KEYS: tuple[str, ...] = ()

    def row_capacity(self, arrays: dict) -> str | None:
        n = len(arrays["image_pixels"])
        if n > self.cfg.max_images_per_row:
            return f"it has {n} images, more than a row holds (max_images_per_row={self.cfg.max_images_per_row})"
        return None

    def pack_lengths(self, length: int) -> dict[str, int]:
        return {k: self.cfg.max_images_per_row for k in self.ROW_KEYS}


class SiglipImages(WholeImages):
    """The siglip kind's side of a document: square pixels [I, C, S, S]; its placeholders were
    expanded in the text (`text_expansion`), so a document's ids hold one run of
    vision_tokens_per_image image tokens per image."""

    ROW_KEYS = ("image_pixels",)
    ROW_MULTIPLE = 1
    PROMPT_MARKS = MARKS
    PAD_VALUES: dict[str, int] = {}

    def __init__(self, cfg):
        self.cfg = cfg

    def encode(self, images: Sequence[Any]) -> dict[str, np.ndarray]:
        from maxlite.data.images import siglip_pixels

        S = self.cfg.vision_image_size
        pixels = [siglip_pixels(image, size=S, mean=self.cfg.image_mean, std=self.cfg.image_std) for image in images]
        return {"image_pixels": np.stack(pixels) if pixels else np.zeros((0, 3, S, S), np.float32)}

    def doc(self, ids: np.ndarray, mask: np.ndarray, images: Sequence[Any], where: str):
        cfg = self.cfg
        is_image = ids == cfg.image_token_id
        starts = np.flatnonzero(is_image & ~np.concatenate([[False], is_image[:-1]]))
        if len(starts) != len(images):
            raise ConfigError(f"{where}: {len(images)} image(s) but {len(starts)} image placeholder(s) in the rendered "
                              f"text: each image needs its own placeholder (the chat template writes one per image item)")
        if int(is_image.sum()) != len(images) * cfg.vision_tokens_per_image:
            raise ConfigError(f"{where}: its image tokens are not {cfg.vision_tokens_per_image} per image "
                              f"(vision_tokens_per_image): write each image as one start-of-image token")
        return ids, mask & ~is_image, None, self.encode(images)

    def synthetic_markers(self) -> list[int]:
        cfg = self.cfg
        return [cfg.vision_start_token_id, *[cfg.image_token_id] * cfg.vision_tokens_per_image,
                cfg.vision_end_token_id]

    def synthetic(self, row: np.ndarray, rng) -> tuple[None, dict[str, np.ndarray]]:
        """(plain positions: None, the row's one random image [1, 3, S, S])."""
        S = self.cfg.vision_image_size
        return None, {"image_pixels": rng.standard_normal((1, 3, S, S)).astype(np.float32)}

    def batch_shapes(self, B: int, T: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """{key: (shape, dtype)} of what `finish` puts in a batch of B packed rows beside the text arrays."""
        S = self.cfg.vision_image_size
        return {"image_pixels": ((B, self.cfg.max_images_per_row, 3, S, S), "float32")}

    def finish(self, row: dict, out: dict) -> None:
        out["image_pixels"] = row["image_pixels"].astype(np.float32)


class Gemma4Images(WholeImages):
    """The gemma4_vit kind's side of a document: each image's patches at its own aspect ratio and
    their (column, row) positions, padded to Np patches; its placeholders expanded in the ids."""

    ROW_KEYS = ("image_pixels", "image_positions")
    ROW_MULTIPLE = 1
    PROMPT_MARKS = ("image_token_id",)  # Gemma4Processor expands the image token alone
    PAD_VALUES = {"image_positions": -1}  # an absent image's patches are all padding
    SYNTHETIC_GRID = (2, 3)  # a synthetic image's soft tokens (rows, columns): its two axes differ

    def __init__(self, cfg):
        self.cfg = cfg
        self.num_patches = cfg.vision_tokens_per_image * cfg.vision_pool_size ** 2  # Np
        self.width = 3 * cfg.vision_patch_size ** 2

    def encode(self, images: Sequence[Any], where: str) -> tuple[list[int], dict[str, np.ndarray]]:
        """(each image's soft tokens, the document's arrays: ROW_KEYS) of PIL images."""
        from maxlite.data.images import gemma4_patches

        cfg, pixels, positions, counts = self.cfg, [], [], []
        for image in images:
            patches_NP, positions_N2, (h, w) = gemma4_patches(
                image, patch_size=cfg.vision_patch_size, pool_size=cfg.vision_pool_size,
                max_soft_tokens=cfg.vision_tokens_per_image, mean=cfg.image_mean, std=cfg.image_std, where=where)
            pixels.append(patches_NP)
            positions.append(positions_N2)
            counts.append(h * w // cfg.vision_pool_size ** 2)
        return counts, self._arrays(pixels, positions)

    def _arrays(self, pixels: list[np.ndarray], positions: list[np.ndarray]) -> dict[str, np.ndarray]:
        if not pixels:
            return {"image_pixels": np.zeros((0, self.num_patches, self.width), np.float32),
                    "image_positions": np.zeros((0, self.num_patches, 2), np.int32)}
        return {"image_pixels": np.stack(pixels), "image_positions": np.stack(positions)}

    def runs(self, ids: np.ndarray, mask: np.ndarray, counts: Sequence[int], where: str):
        """(ids, mask) with the k-th placeholder replaced by boi, image × counts[k], eoi (never supervised)."""
        cfg = self.cfg
        at = placeholders(ids, cfg.image_token_id, len(counts), where)
        pieces, masks, start = [], [], 0
        for a, n in zip(at, counts):
            pieces += [ids[start:a], np.array([cfg.vision_start_token_id, *[cfg.image_token_id] * n,
                                               cfg.vision_end_token_id], ids.dtype)]
            masks += [mask[start:a], np.zeros(n + 2, bool)]
            start = a + 1
        return np.concatenate([*pieces, ids[start:]]), np.concatenate([*masks, mask[start:]])

    def doc(self, ids: np.ndarray, mask: np.ndarray, images: Sequence[Any], where: str):
        counts, arrays = self.encode(images, where)
        ids, mask = self.runs(ids, mask, counts, where)
        return ids, mask, None, arrays

    def synthetic_markers(self) -> list[int]:
        cfg, (h, w) = self.cfg, self._synthetic_grid()
        return [cfg.vision_start_token_id, *[cfg.image_token_id] * (h * w), cfg.vision_end_token_id]

    def _synthetic_grid(self) -> tuple[int, int]:
        """SYNTHETIC_GRID, or one row of soft tokens where vision_tokens_per_image holds fewer."""
        h, w = self.SYNTHETIC_GRID
        T = self.cfg.vision_tokens_per_image
        return (h, w) if h * w <= T else (1, max(1, min(w, T)))

    def synthetic(self, row: np.ndarray, rng) -> tuple[None, dict[str, np.ndarray]]:
        """(plain positions: None, the row's one random image: [1, Np, p·p·3] patches, [1, Np, 2] positions)."""
        from maxlite.data.images import gemma4_positions

        pool, (h, w) = self.cfg.vision_pool_size, self._synthetic_grid()
        n = h * w * pool ** 2
        pixels = np.zeros((self.num_patches, self.width), np.float32)
        pixels[:n] = rng.standard_normal((n, self.width))
        return None, self._arrays([pixels], [gemma4_positions(h * pool, w * pool, self.num_patches)])

    def batch_shapes(self, B: int, T: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """{key: (shape, dtype)} of what `finish` puts in a batch of B packed rows beside the text arrays."""
        M, N = self.cfg.max_images_per_row, self.num_patches
        return {"image_pixels": ((B, M, N, self.width), "float32"), "image_positions": ((B, M, N, 2), "int32")}

    def finish(self, row: dict, out: dict) -> None:
        # packing pads a row's empty image slots with zeros: (0, 0) would be a real patch's position
        empty = row["image_positions_segment_ids"] == 0
        out["image_pixels"] = row["image_pixels"].astype(np.float32)
        out["image_positions"] = np.where(empty[:, None, None], -1, row["image_positions"]).astype(np.int32)


def text_expansion(cfg, tokenizer) -> tuple[str, str] | None:
    """(the placeholder's text, what it becomes) for a kind that expands in the text (siglip: Gemma3Processor's
    full_image_sequence), else None. The token texts come from the tokenizer."""
    if cfg.vision_encoder != "siglip":
        return None
    backend = tokenizer._backend
    names = {}
    for key in ("vision_start_token_id", "image_token_id", "vision_end_token_id"):
        tid = getattr(cfg, key)
        names[key] = backend.id_to_token(tid) if tid >= 0 and hasattr(backend, "id_to_token") else None
        if not names[key]:
            raise ConfigError(f"{key}={tid} is not a token of {tokenizer.path}: Gemma 3's images need its "
                              f"<start_of_image>, <image_soft_token> and <end_of_image>")
    boi = names["vision_start_token_id"]
    return boi, (f"\n\n{boi}{names['image_token_id'] * cfg.vision_tokens_per_image}"
                 f"{names['vision_end_token_id']}\n\n")


def expand_text(text: str, spans: Sequence[tuple[int, int]], expansion: tuple[str, str] | None):
    """(text with each placeholder replaced, `spans` (character ranges) moved with it)."""
    if expansion is None or expansion[0] not in text:
        return text, list(spans)
    old, new = expansion
    at = [i for i in range(len(text)) if text.startswith(old, i)]
    grow = len(new) - len(old)

    def moved(c: int) -> int:
        return c + grow * sum(1 for a in at if a < c)
    return text.replace(old, new), [(moved(lo), moved(hi)) for lo, hi in spans]


KINDS = {"qwen_vit": QwenImages, "siglip": SiglipImages, "gemma4_vit": Gemma4Images}


def kind_of(cfg):
    """The encoder kind's side of a document (data and prompts)."""
    return KINDS[cfg.vision_encoder](cfg)
