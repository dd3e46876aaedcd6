"""A synthetic vision-language task small enough to learn on a CPU in minutes: shapes.

    python -m maxlite.data.vision_task OUT_DIR [--train 2000] [--eval 200] [--seed 0] [--parquet]

Generated from the seed when asked for (nothing is shipped). Each example is one PNG of a random
size, 40–96 pixels a side and never a multiple of 16 (so the processors' resize and the patch grid
are exercised), on a plain white or light-grey background, with 1–4 filled shapes (circle, square,
triangle) that do not touch, each in its own colour, drawn without anti-aliasing so every pixel is
either background or exactly one shape's colour. One question per image, with a one-word answer:
  "How many shapes are there?"          → "3"
  "What colour is the square?"          → "red"     (only when one square is drawn)
  "What shape is the blue one?"         → "circle"
  "What shape is it?"                   → "triangle" (only when one shape is drawn)

OUT_DIR gets images/{train,eval}_NNNNN.png and train.jsonl / eval.jsonl in the chat format, image
paths relative to the jsonl:
  {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/train_00012.png"},
                                             {"type": "text", "text": "How many shapes are there?"}]},
                {"role": "assistant", "content": "3"}]}
With --parquet also train.parquet / eval.parquet, the same records with each image as
{"bytes": <png>, "path": ...} (as HF datasets store images) and every content a list of parts
(a parquet column holds one type, so the answer is [{"type": "text", "text": "3"}]).

The train and eval splits are drawn from separate streams of the seed, so the eval set is the
same whatever --train is. `answer_accuracy` scores a model's answers on the eval split.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220),
           "yellow": (240, 200, 20), "purple": (140, 50, 170)}
BACKGROUNDS = ((255, 255, 255), (225, 225, 225))
KINDS = ("circle", "square", "triangle")
SIDE = (40, 96)  # inclusive range of an image side, multiples of 16 left out
SHAPE = 10  # smallest shape side: big enough that its kind is visible after the resize
GAP = 2  # pixels between shapes, and from the border
_SPLITS = {"train": 0, "eval": 1}


def _side(rng: np.random.Generator) -> int:
    while (side := int(rng.integers(SIDE[0], SIDE[1] + 1))) % 16 == 0:
        pass
    return side


def _place(rng: np.random.Generator, width: int, height: int, count: int) -> list[tuple[int, int, int]] | None:
    """`count` non-touching squares (x, y, side), or None when random tries did not fit them."""
    boxes: list[tuple[int, int, int]] = []
    biggest = max(SHAPE, min(width, height) // 2 - GAP)
    for _ in range(count):
        for _ in range(50):
            s = int(rng.integers(SHAPE, biggest + 1))
            x = int(rng.integers(GAP, width - GAP - s + 1))
            y = int(rng.integers(GAP, height - GAP - s + 1))
            if all(x + s + GAP <= bx or bx + bs + GAP <= x or y + s + GAP <= by or by + bs + GAP <= y
                   for bx, by, bs in boxes):
                boxes.append((x, y, s))
                break
        else:
            return None
    return boxes


def _draw(draw: ImageDraw.ImageDraw, kind: str, box: tuple[int, int, int], fill: tuple[int, int, int]) -> None:
    x, y, s = box
    x1, y1 = x + s - 1, y + s - 1  # Pillow's boxes include their last pixel
    if kind == "circle":
        draw.ellipse((x, y, x1, y1), fill=fill)
    elif kind == "square":
        draw.rectangle((x, y, x1, y1), fill=fill)
    else:
        draw.polygon([(x + (s - 1) / 2, y), (x1, y1), (x, y1)], fill=fill)


def _question(rng: np.random.Generator, shapes: list[tuple[str, str]]) -> tuple[str, str]:
    """One (question, answer) about the drawn shapes [(kind, colour)]: a kind of question (count,
    colour, shape) drawn evenly among those with a single right answer here, then one of its forms."""
    kinds = [k for k, _ in shapes]
    count = [("How many shapes are there?", str(len(shapes)))]
    colour = [(f"What colour is the {k}?", c) for k, c in shapes if kinds.count(k) == 1]
    shape = [(f"What shape is the {c} one?", k) for k, c in shapes]
    if len(shapes) == 1:
        shape.append(("What shape is it?", kinds[0]))
    options = [o for o in (count, colour, shape) if o]
    chosen = options[int(rng.integers(len(options)))]
    return chosen[int(rng.integers(len(chosen)))]


def shapes_example(rng: np.random.Generator) -> tuple[Image.Image, str, str]:
    """One image, question and answer drawn from `rng`."""
    width, height = _side(rng), _side(rng)
    while (boxes := _place(rng, width, height, int(rng.integers(1, 5)))) is None:
        pass
    colours = rng.choice(list(COLOURS), size=len(boxes), replace=False)
    shapes = [(KINDS[int(rng.integers(len(KINDS)))], str(c)) for c in colours]
    image = Image.new("RGB", (width, height), BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))])
    draw = ImageDraw.Draw(image)
    for (kind, colour), box in zip(shapes, boxes):
        _draw(draw, kind, box, COLOURS[colour])
    question, answer = _question(rng, shapes)
    return image, question, answer


def _record(image_ref, question: str, answer) -> dict:
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "image": image_ref}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": answer}]}


def write_shapes_task(out_dir: str | pathlib.Path, *, train: int = 2000, eval: int = 200, seed: int = 0,
                      parquet: bool = False) -> dict[str, pathlib.Path]:
    """Write the task under `out_dir`; returns the written record files by name
    ("train", "eval", and "train_parquet", "eval_parquet" with `parquet`)."""
    out = pathlib.Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    written = {}
    for split, count in (("train", train), ("eval", eval)):
        rng = np.random.default_rng((seed, _SPLITS[split]))
        records, parquet_records = [], []
        for i in range(count):
            image, question, answer = shapes_example(rng)
            rel = f"images/{split}_{i:05d}.png"
            image.save(out / rel)
            records.append(_record(rel, question, answer))
            if parquet:
                png = (out / rel).read_bytes()
                parquet_records.append(_record({"bytes": png, "path": rel}, question,
                                               [{"type": "text", "text": answer}]))
        written[split] = out / f"{split}.jsonl"
        written[split].write_text("".join(json.dumps(r) + "\n" for r in records))
        if parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq
            written[f"{split}_parquet"] = out / f"{split}.parquet"
            pq.write_table(pa.Table.from_pylist(parquet_records), written[f"{split}_parquet"])
    return written


def answer_accuracy(predictions: Sequence[str], eval_path: str | pathlib.Path) -> float:
    """Exact-match accuracy of `predictions` (one per record, in order) against the answers in the
    eval jsonl, ignoring case and surrounding whitespace."""
    lines = pathlib.Path(eval_path).read_text().splitlines()
    answers = [json.loads(line)["messages"][-1]["content"] for line in lines if line.strip()]
    if len(predictions) != len(answers):
        raise ValueError(f"{eval_path}: {len(answers)} records but {len(predictions)} predictions")
    if not answers:
        raise ValueError(f"{eval_path}: no records")
    hits = sum(p.strip().casefold() == a.strip().casefold() for p, a in zip(predictions, answers))
    return hits / len(answers)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxlite.data.vision_task", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=2000, help="training examples")
    parser.add_argument("--eval", type=int, default=200, help="held-out examples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parquet", action="store_true", help="also write {train,eval}.parquet, images as bytes")
    args = parser.parse_args(argv)
    if args.train < 0 or args.eval < 0:
        parser.error("--train and --eval must be >= 0")
    written = write_shapes_task(args.out_dir, train=args.train, eval=args.eval, seed=args.seed, parquet=args.parquet)
    counts = {"train": args.train, "eval": args.eval}
    for name, path in written.items():
        print(f"wrote {path} ({counts[name.split('_')[0]]} examples)")
    print(f"images in {pathlib.Path(args.out_dir) / 'images'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
