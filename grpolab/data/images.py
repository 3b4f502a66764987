"""Reading a data row's images: PIL images, file paths, and the ``{"bytes", "path"}`` form that the ``datasets``
library's ``Image`` feature stores in Parquet (in JSON lines, where bytes cannot go, ``bytes`` is base64 text)."""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path

from grpolab.data.jsonl import DataError

IMAGE_COLUMNS = ("image", "images")
"""The columns a row's images come in, as in TRL: one image, or a list of them."""


def load_image(value, where: str, base: Path | None = None):
    """The RGB ``PIL.Image`` that ``value`` holds or names; a :class:`DataError` naming ``where`` (the row and the
    column) when it cannot be read. A relative path is read from ``base`` (the data file's folder) when it is there,
    else from the working directory."""
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, dict) and value.get("bytes") is not None:
            raw = value["bytes"]  # JSON cannot hold bytes: there they come base64-encoded
            image = Image.open(io.BytesIO(base64.b64decode(raw) if isinstance(raw, str) else raw))
        elif isinstance(value, dict) and value.get("path"):
            image = Image.open(_located(value["path"], base))
        elif isinstance(value, str | Path):
            image = Image.open(_located(value, base))
        else:
            raise DataError(
                f"{where}: an image must be a PIL image, a file path or {{'bytes', 'path'}}, got {type(value).__name__}"
            )
        image.load()  # read now: a truncated file fails here, not in the middle of a step
    except (OSError, UnidentifiedImageError) as e:
        raise DataError(f"{where}: cannot read the image ({e})") from None
    return image.convert("RGB")


def _located(path: str | Path, base: Path | None) -> Path:
    path = Path(path).expanduser()
    if not path.is_absolute() and base is not None and (base / path).exists():
        return base / path
    return path


def _values(record: dict):
    """``(label, value)`` for each image a record holds, in order: its ``image`` column, then each of its ``images``
    list; the label names the column (and the place in a list)."""
    for column in IMAGE_COLUMNS:
        value = record.get(column)
        if value is None:
            continue
        if column == "images" and isinstance(value, list | tuple):
            yield from ((f"column {column!r} [{i}]", v) for i, v in enumerate(value))
        else:
            yield f"column {column!r}", value


def row_images(record: dict, where: str = "row", base: Path | None = None) -> list:
    """A record's images in order: its ``image`` column (one) or ``images`` column (a list), read
    (:func:`load_image`); ``[]`` when it has neither."""
    return [load_image(v, f"{where}, {label}", base) for label, v in _values(record)]


def checked_images(row: dict, where: str, base: Path | None) -> dict:
    """``row`` with its images checked before any step runs: each must be readable (else a :class:`DataError`
    naming the row and the column), and a relative path is made absolute where it is found under ``base`` (the data
    file's folder), so that it reads the same from any working directory."""

    def located(label: str, v):
        load_image(v, f"{where}, {label}", base)
        if isinstance(v, str) and base is not None and not Path(v).is_absolute() and (base / v).exists():
            return str((base / v).resolve())
        return v

    out = dict(row)
    for column in IMAGE_COLUMNS:
        value = row.get(column)
        if value is None:
            continue
        values = [located(label, v) for label, v in _values({column: value})]
        out[column] = values if column == "images" and isinstance(value, list | tuple) else values[0]
    return out


def images_identity(record: dict) -> str:
    """A short digest of a record's images ('' without any), for telling rows apart: the same question about another
    picture is another row. PIL images by their pixels, bytes by their bytes, paths by the path."""
    from PIL import Image

    digest = hashlib.sha256()
    found = False
    for _, v in _values(record):
        found = True
        if isinstance(v, Image.Image):
            digest.update(v.tobytes())
        elif isinstance(v, dict) and v.get("bytes") is not None:
            digest.update(v["bytes"] if isinstance(v["bytes"], bytes) else v["bytes"].encode())
        else:
            digest.update(str(v.get("path") if isinstance(v, dict) else v).encode())
    return f" [images {digest.hexdigest()[:16]}]" if found else ""


def shown_images(record: dict) -> dict:
    """``{"images": [...]}`` for a sample's log line when the record has images (``{}`` else): each a path or a PIL
    image (the run's log keeps a PIL image as a file of its own; bytes are read into one)."""
    out = []
    for label, v in _values(record):
        if isinstance(v, dict):
            v = v.get("path") if v.get("bytes") is None else load_image(v, label)
        out.append(v)
    return {"images": out} if out else {}
