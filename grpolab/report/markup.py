"""What every HTML page of the report writes values with: escaped text, and PNG figures embedded as base64 (the
pages load nothing from outside themselves)."""

from __future__ import annotations

import base64
import html


def escape(value) -> str:
    """``value`` as text safe inside HTML and inside a quoted attribute."""
    return html.escape(str(value), quote=True)


def png_img(data: bytes, alt: str) -> str:
    """An ``<img>`` holding the PNG ``data`` itself."""
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
