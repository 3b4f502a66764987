"""Pages read back: the token view's HTML cards, and the names a docs page lists."""

from __future__ import annotations

from html.parser import HTMLParser

from .paths import REPO


class TokenCards(HTMLParser):
    """The rollout cards of the token view's HTML: each card's column, data attributes and token spans."""

    def __init__(self):
        super().__init__()
        self.cards: list[dict] = []
        self.column = ""
        self.tags: list[str] = []
        self.open: list[dict | None] = []
        self.in_text = False  # inside a card's div.tc-text (the legend has a marker too)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        cls = (a.get("class") or "").split()
        if "tc-col" in cls:
            self.column = "pos" if "tc-pos" in cls else "neg"
        if "tc-roll" in cls:
            self.cards.append({"column": self.column, **{k[5:]: int(v) for k, v in a.items() if k.startswith("data-")}})
            self.cards[-1]["tokens"] = []
        self.in_text = self.in_text or "tc-text" in cls
        span = None
        if tag == "span" and self.in_text and ("tok" in cls or "tok-mark" in cls):
            span = {"text": "", "mark": "tok-mark" in cls, "style": a.get("style", ""), "title": a.get("title", "")}
            self.cards[-1]["tokens"].append(span)
        self.open.append(span)

    def handle_endtag(self, tag):
        self.open.pop()
        self.in_text = self.in_text and tag != "div"

    def handle_data(self, data):
        span = next((s for s in reversed(self.open) if s is not None), None)  # a newline sits in a nested span
        if span is not None:
            span["text"] += data


def token_cards(page: str) -> TokenCards:
    cards = TokenCards()
    cards.feed(page)
    return cards


def docs_listed(page: str, lead: str, after: str) -> set[str]:
    """The backticked names that docs/``page`` lists in the bullet starting with ``lead`` (in bold), from the words
    ``after`` to the end of their sentence."""
    import re

    text = (REPO / "docs" / page).read_text()
    bullet = text[text.index(f"- **{lead}**") :]
    listed = bullet[bullet.index(after) + len(after) :]
    return set(re.findall(r"`([^`]+)`", listed[: listed.index(". ")]))
