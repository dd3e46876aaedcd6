"""maxlite/data/images.py against the HF image processors' PIL backends, and the bundled shapes task
(maxlite/data/vision_task.py) against the pixels it draws.

The preprocessing is compared bit for bit: ours runs the same Pillow resize on the same uint8 image
and the same float64-rescale / float32-normalize as transformers 5's PIL backends, so any difference
is a real change (an order of patches, a resample, a dtype), not rounding.
"""

import base64
import io
import json
import pathlib

import numpy as np
import pytest
from PIL import Image

from maxlite.data import images, vision_task

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def _random_image(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _png(image: Image.Image, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG", **save)
    return out.getvalue()


# (width, height, settings): 45×70 rounds to the 56×56 minimum, 97×31 is scaled up to reach
# min_pixels, 200×150 is scaled down to the max_pixels budget; the last is Qwen3-VL's 16-pixel
# patches with its 0.5 mean/std.
QWEN_CASES = [
    (45, 70, dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=56 * 56, max_pixels=112 * 112,
                  mean=CLIP_MEAN, std=CLIP_STD)),
    (97, 31, dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=56 * 56, max_pixels=112 * 112,
                  mean=CLIP_MEAN, std=CLIP_STD)),
    (200, 150, dict(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=56 * 56, max_pixels=112 * 112,
                    mean=CLIP_MEAN, std=CLIP_STD)),
    (123, 77, dict(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=64 * 64, max_pixels=128 * 128,
                   mean=[0.5] * 3, std=[0.5] * 3)),
]


@pytest.mark.parametrize("width,height,settings", QWEN_CASES, ids=["45x70", "97x31", "200x150", "123x77-p16"])
def test_qwen_patches_equal_hf_processor(width, height, settings):
    from transformers import Qwen2VLImageProcessorPil
    image = _random_image(width, height)
    hf = Qwen2VLImageProcessorPil(
        patch_size=settings["patch_size"], temporal_patch_size=settings["temporal_patch_size"],
        merge_size=settings["merge_size"], min_pixels=settings["min_pixels"], max_pixels=settings["max_pixels"],
        image_mean=settings["mean"], image_std=settings["std"])(image, return_tensors="np")
    rows, grid_thw = images.qwen_patches(image, **settings)
    assert rows.dtype == np.float32
    assert grid_thw == tuple(hf["image_grid_thw"][0])
    np.testing.assert_array_equal(rows, hf["pixel_values"])  # bitwise: same resize, same float ops
    merge = settings["merge_size"]
    assert images.qwen_tokens(grid_thw, merge) * merge**2 == len(hf["pixel_values"])  # a token per merge² rows


@pytest.mark.parametrize("resample", [Image.Resampling.BILINEAR, Image.Resampling.BICUBIC])
def test_siglip_pixels_equal_hf_processor(resample):
    from transformers import Gemma3ImageProcessorPil
    image = _random_image(83, 45, seed=1)
    hf = Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                 resample=resample)(image, return_tensors="np")
    assert hf["num_crops"].tolist() == [0]  # no pan-and-scan: one image, one crop
    ours = images.siglip_pixels(image, size=64, mean=[0.5] * 3, std=[0.5] * 3, resample=resample)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, hf["pixel_values"][0])


def test_siglip_default_resample_is_gemma3s():
    from transformers import Gemma3ImageProcessorPil
    image = _random_image(50, 90, seed=2)
    hf = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})(image, return_tensors="np")
    ours = images.siglip_pixels(image, size=32, mean=Gemma3ImageProcessorPil.image_mean,
                                std=Gemma3ImageProcessorPil.image_std)
    np.testing.assert_array_equal(ours, hf["pixel_values"][0])


def test_load_image_from_every_kind_of_reference(tmp_path, monkeypatch):
    image = _random_image(21, 13, seed=3)
    pixels = np.asarray(image)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "x.png").write_bytes(_png(image))
    data = (tmp_path / "img" / "x.png").read_bytes()
    monkeypatch.setenv("HOME", str(tmp_path))
    refs = {
        "relative path": "img/x.png",
        "absolute path": str(tmp_path / "img" / "x.png"),
        "~ path": "~/img/x.png",
        "bytes": data,
        "dict bytes": {"bytes": data, "path": "somewhere/else.png"},
        "dict path": {"bytes": None, "path": "img/x.png"},
        "data URI": "data:image/png;base64," + base64.b64encode(data).decode(),
    }
    for name, ref in refs.items():
        loaded = images.load_image(ref, base_dir=tmp_path, where="t.jsonl record 1")
        assert loaded.mode == "RGB", name
        np.testing.assert_array_equal(np.asarray(loaded), pixels, err_msg=name)


def test_load_image_from_a_url():
    """Served from this machine's loopback: the tests never reach the network."""
    import http.server
    import threading
    data = _png(_random_image(9, 7, seed=7))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/x.png"
        loaded = images.load_image(url, base_dir="/nonexistent", where="r")
    finally:
        server.shutdown()
    np.testing.assert_array_equal(np.asarray(loaded), np.asarray(Image.open(io.BytesIO(data))))


def test_load_image_converts_to_rgb_as_the_hf_processors_do():
    from transformers.image_transforms import convert_to_rgb
    rgb = _random_image(17, 11, seed=4)
    pixels = np.asarray(rgb)
    alpha = np.random.default_rng(5).integers(0, 256, pixels.shape[:2], dtype=np.uint8)

    def load(im: Image.Image) -> np.ndarray:
        return np.asarray(images.load_image(_png(im), base_dir=".", where="r"))

    opaque = rgb.copy()
    opaque.putalpha(255)
    np.testing.assert_array_equal(load(opaque), pixels)
    gray = rgb.convert("L")
    np.testing.assert_array_equal(load(gray), np.repeat(np.asarray(gray)[..., None], 3, axis=-1))
    palette = rgb.quantize(16)
    np.testing.assert_array_equal(load(palette), np.asarray(palette.convert("RGB")))
    # transparency: composited onto white, as transformers' convert_to_rgb does before preprocessing
    translucent = rgb.copy()
    translucent.putalpha(Image.fromarray(alpha))
    np.testing.assert_array_equal(load(translucent), convert_to_rgb(translucent, return_numpy=True))
    assert not np.array_equal(load(translucent), pixels)
    palette.info["transparency"] = 3
    with Image.open(io.BytesIO(_png(palette, transparency=3))) as reread:
        np.testing.assert_array_equal(load(palette), convert_to_rgb(reread, return_numpy=True))


def test_load_image_applies_exif_orientation():
    image = _random_image(8, 5, seed=6)
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    loaded = images.load_image(_png(image, exif=exif), base_dir=".", where="r")
    np.testing.assert_array_equal(np.asarray(loaded), np.rot90(np.asarray(image), k=-1))


@pytest.mark.parametrize("ref,message", [
    ("img/missing.png", "image 'img/missing.png' does not exist"),
    (b"just some text, not a picture", "image of 29 bytes is not a readable image (unknown format)"),
    ("data:image/png;base64,@@not base64@@", "image data URI is not valid base64"),
    ("data:image/png,rawbytes", "image data URI is not of the form data:image/...;base64,<data>"),
    (12, "image is a int, not a path"),
    ({"bytes": None, "path": None}, "image {'bytes', 'path'} holds neither bytes nor a path"),
    ({"bytes": b"GIF89a-cut", "path": "a/b.gif"}, "image 'a/b.gif' (of 10 bytes) is not a readable image"),
    ("http://127.0.0.1:9/x.png", "image 'http://127.0.0.1:9/x.png' could not be fetched ("),  # nothing listens
])
def test_bad_image_is_one_line_naming_the_record(tmp_path, ref, message):
    with pytest.raises(ValueError) as err:
        images.load_image(ref, base_dir=tmp_path, where="train.jsonl record 12")
    text = str(err.value)
    assert text.startswith("train.jsonl record 12: ") and message in text and "\n" not in text


def test_truncated_and_text_files_are_not_readable(tmp_path):
    (tmp_path / "notes.png").write_text("hello\nworld\n")
    (tmp_path / "cut.png").write_bytes(_png(_random_image(40, 40))[:300])
    for name in ("notes.png", "cut.png"):
        with pytest.raises(ValueError, match=rf"^r 3: image '{name}' is not a readable image \(.+\)$"):
            images.load_image(name, base_dir=tmp_path, where="r 3")


# --- the shapes task -------------------------------------------------------------------------------

def _records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _colour_masks(pixels: np.ndarray) -> dict[str, np.ndarray]:
    """The pixels of each named colour in the image; asserts every other pixel is the background."""
    masks = {name: np.all(pixels == rgb, axis=-1) for name, rgb in vision_task.COLOURS.items()}
    masks = {name: m for name, m in masks.items() if m.any()}
    background = ~np.any(list(masks.values()), axis=0) if masks else np.ones(pixels.shape[:2], bool)
    assert len({tuple(p) for p in pixels[background]}) == 1, "a pixel neither background nor a named colour"
    return masks


def _kind(mask: np.ndarray) -> str:
    """A shape's kind from how much of its bounding box it fills: square 1, circle ~π/4, triangle ~1/2."""
    ys, xs = np.nonzero(mask)
    fill = mask.sum() / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))
    return "square" if fill > 0.95 else "circle" if 0.65 < fill < 0.9 else "triangle" if fill < 0.6 else "?"


def test_shapes_answers_agree_with_the_drawn_pixels(tmp_path):
    paths = vision_task.write_shapes_task(tmp_path, train=120, eval=0, seed=0)
    asked = set()
    for r in _records(paths["train"]):
        (image_part, text_part), answer = r["messages"][0]["content"], r["messages"][1]["content"]
        image = images.load_image(image_part["image"], base_dir=tmp_path, where="test")
        assert image.width % 16 and image.height % 16 and 40 <= min(image.size) <= max(image.size) <= 96
        masks = _colour_masks(np.asarray(image))
        kinds = {colour: _kind(m) for colour, m in masks.items()}
        q = text_part["text"]
        if q == "How many shapes are there?":
            assert answer == str(len(masks)) and 1 <= len(masks) <= 4
        elif q == "What shape is it?":
            assert list(kinds.values()) == [answer]
        elif q.startswith("What shape is the "):
            assert kinds[q.split()[4]] == answer
        else:
            kind = q.removeprefix("What colour is the ").removesuffix("?")
            assert [c for c, k in kinds.items() if k == kind] == [answer]
        asked.add(q.split()[1] if q != "What shape is it?" else "it")
    assert asked == {"many", "colour", "shape", "it"}


def test_shapes_task_is_deterministic_per_seed(tmp_path):
    def pixels(root, seed):
        paths = vision_task.write_shapes_task(root, train=6, eval=4, seed=seed)
        return paths, [np.asarray(images.load_image(r["messages"][0]["content"][0]["image"], base_dir=root, where="t"))
                       for split in ("train", "eval") for r in _records(paths[split])]

    a_paths, a = pixels(tmp_path / "a", 0)
    b_paths, b = pixels(tmp_path / "b", 0)
    _, c = pixels(tmp_path / "c", 1)
    for split in ("train", "eval"):
        assert a_paths[split].read_text() == b_paths[split].read_text()
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, c))
    # the eval split does not depend on how many training examples were asked for
    more = vision_task.write_shapes_task(tmp_path / "d", train=9, eval=4, seed=0)
    assert more["eval"].read_text() == a_paths["eval"].read_text()


def test_parquet_records_decode_to_the_jsonl_images(tmp_path):
    import pyarrow.parquet as pq
    paths = vision_task.write_shapes_task(tmp_path, train=5, eval=3, seed=2, parquet=True)
    for split in ("train", "eval"):
        rows = pq.read_table(paths[f"{split}_parquet"]).to_pylist()
        lines = _records(paths[split])
        assert len(rows) == len(lines)
        for row, line in zip(rows, lines):
            (p_image, p_text), (j_image, j_text) = row["messages"][0]["content"], line["messages"][0]["content"]
            assert p_text["text"] == j_text["text"]
            assert row["messages"][1]["content"][0]["text"] == line["messages"][1]["content"]
            assert p_image["image"]["path"] == j_image["image"]
            from_bytes = images.load_image(p_image["image"], base_dir="/nonexistent", where="parquet")
            from_file = images.load_image(j_image["image"], base_dir=tmp_path, where="jsonl")
            np.testing.assert_array_equal(np.asarray(from_bytes), np.asarray(from_file))


def test_answer_accuracy(tmp_path):
    paths = vision_task.write_shapes_task(tmp_path, train=0, eval=10, seed=0)
    answers = [r["messages"][1]["content"] for r in _records(paths["eval"])]
    assert vision_task.answer_accuracy([f"  {a.upper()}\n" for a in answers], paths["eval"]) == 1.0
    wrong = answers[:]
    wrong[3] = "not an answer"
    assert vision_task.answer_accuracy(wrong, paths["eval"]) == 0.9
    with pytest.raises(ValueError, match="10 records but 9 predictions"):
        vision_task.answer_accuracy(answers[:9], paths["eval"])


def test_entry_point_says_what_it_wrote(tmp_path, capsys):
    assert vision_task.main([str(tmp_path), "--train", "3", "--eval", "2", "--seed", "4"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'train.jsonl'} (3 examples)" in out and f"{tmp_path / 'eval.jsonl'} (2 examples)" in out
    assert len(_records(tmp_path / "train.jsonl")) == 3 and len(list((tmp_path / "images").glob("*.png"))) == 5
