"""What every HTML page of the report writes values with: escaped text, PNG figures embedded as base64, and a row's
pictures as thumbnails (the pages load nothing from outside themselves)."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable
from pathlib import Path


def escape(value) -> str:
    """``value`` as text safe inside HTML and inside a quoted attribute."""
    return html.escape(str(value), quote=True)


def png_img(data: bytes, alt: str) -> str:
    """An ``<img>`` holding the PNG ``data`` itself."""
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def thumbnails(images: list, run_dir: Path, side: int = 96) -> str:
    """Each image (a path, relative to the run where its log stored it) as a thumbnail embedded in the page, at most
    ``side`` pixels a side; an image that cannot be read is named instead."""
    from PIL import Image

    out = []
    for path in images:
        where = Path(run_dir) / path if not Path(str(path)).is_absolute() else Path(str(path))
        try:
            with Image.open(where) as image:
                small = image.convert("RGB")
                small.thumbnail((side, side))
                buf = io.BytesIO()
                small.save(buf, format="PNG")
        except (OSError, ValueError):
            out.append(f'<span class="sub">[image {escape(path)}: not found]</span>')
            continue
        out.append(png_img(buf.getvalue(), str(path)).replace("<img ", '<img class="thumb" '))
    return f'<div class="thumbs">{"".join(out)}</div>' if out else ""


def table(header: list[str] | None, rows: Iterable[list[str]], left: int = 1) -> str:
    """Cells are HTML already (escaped by the caller); the first ``left`` columns align left; no header row if None."""
    th = "".join(f'<th class="{"l" if i < left else ""}">{h}</th>' for i, h in enumerate(header or []))
    body = "".join(
        "<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{c}</td>' for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table>{f'<tr>{th}</tr>' if header else ''}{body}</table>"
