"""``make-shards csv``: image-caption shards from a CSV, TSV or JSONL table of image path + caption.

Columns are named (open_clip's defaults: ``filepath``, ``title``). Relative paths are resolved
against ``image_root`` (default: the table's folder). Rows naming the same image share one
``image_id``: the ``id_column`` value when given (an integer), else the order of first appearance.
The separator follows the suffix (``.tsv`` tab, ``.csv`` comma, ``.jsonl`` JSON Lines) unless
``sep`` is given. Layouts as in ``write_coco``.
"""
from __future__ import annotations

import csv
import io
import os

from mplug_pretrain.data.writers.coco import CaptionedImage, write_captioned_images
from mplug_pretrain.data.writers.common import load_records
from mplug_pretrain.errors import DataError


def read_table(path: str, sep: str | None = None) -> list[dict]:
    """Rows as {column: value}. A row with more or fewer fields than the header (an unquoted separator in a
    caption) is refused with its line number rather than cut short; a file that is not UTF-8 is one DataError."""
    if path.endswith(".jsonl") and sep is None:
        return load_records(path)
    delimiter = sep if sep is not None else ("\t" if path.endswith(".tsv") else ",")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line}: not UTF-8 text (byte {raw[err.start]:#04x}); save the table as "
                        "UTF-8, e.g. `iconv -f latin1 -t utf-8 IN > OUT`") from err
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    rows = []
    for row in reader:
        if None in row or None in row.values():
            fields = len(reader.fieldnames) + len(row.get(None, [])) - sum(v is None for v in row.values())
            raise DataError(f"{path}: row {reader.line_num}: {fields} fields where the header has "
                            f"{len(reader.fieldnames)} ({delimiter.join(reader.fieldnames)}); quote a value that "
                            f"holds {delimiter!r} (\"an orange, sliced\")")
        rows.append(row)
    return rows


def group_rows(rows: list[dict], table: str, *, image_column: str, caption_column: str, id_column: str | None,
               image_root: str) -> list[CaptionedImage]:
    if not rows:
        raise DataError(f"{table}: no rows")
    for column in filter(None, (image_column, caption_column, id_column)):
        if column not in rows[0]:
            raise DataError(f"{table}: no column {column!r}; columns: {sorted(rows[0])}")
    by_path: dict[str, CaptionedImage] = {}
    for line, row in enumerate(rows, 2 if not table.endswith(".jsonl") else 1):
        path = os.path.join(image_root, str(row[image_column]))
        caption = str(row[caption_column] or "").strip()
        if not caption:
            raise DataError(f"{table}: row {line}: empty {caption_column!r}")
        if path not in by_path:
            try:
                image_id = int(row[id_column]) if id_column else len(by_path)
            except (TypeError, ValueError) as err:
                raise DataError(f"{table}: row {line}: {id_column!r} is not an integer: {row[id_column]!r}") from err
            by_path[path] = CaptionedImage(image_id, path, origin=f"{table}: row {line}")
        entry = by_path[path]
        entry.captions.append(caption)
        entry.caption_ids.append(line)
    ids = [img.image_id for img in by_path.values()]
    if len(set(ids)) != len(ids):
        raise DataError(f"{table}: {id_column!r} gives the same id to different images")
    return list(by_path.values())


def write_table_shards(table: str, out: str, *, image_column: str = "filepath", caption_column: str = "title",
                       id_column: str | None = None, image_root: str | None = None, sep: str | None = None,
                       layout: str = "pair", name: str = "table", max_image_side: int | None = None,
                       skip_missing: bool = False, max_samples: int = 1000, max_bytes: int | None = None,
                       overwrite: bool = False) -> dict:
    """Returns the manifest entry. ``caption_id`` in json is the table line number."""
    root = image_root if image_root is not None else os.path.dirname(os.path.abspath(table))
    images = group_rows(read_table(table, sep), table, image_column=image_column, caption_column=caption_column,
                        id_column=id_column, image_root=root)
    description = f"make-shards csv --table {table} --image-column {image_column} --caption-column {caption_column}"
    return write_captioned_images(images, out, name=name, layout=layout, description=description,
                                  max_image_side=max_image_side, skip_missing=skip_missing,
                                  max_samples=max_samples, max_bytes=max_bytes, overwrite=overwrite)
