"""Checks of a parsed request body's text before anything reads it: every string must be
encodable as UTF-8 (JSON's ``"\\ud800"`` escape decodes to a lone surrogate, which the
tokenizer and the response encoder cannot take), and the body's text is bounded in
characters (``--max-text-chars``), well below what ``--max-body-bytes`` lets through, so that
no request holds a tokenizer for long. Both are a 400 naming the field."""

from __future__ import annotations

from pydantic import BaseModel

from tokenlake.serve.api.errors import APIError

MAX_TEXT_CHARS = 1 << 20  # --max-text-chars' default: a 1 Mi-character prompt is ~250k tokens


def check_text(body: BaseModel, max_chars: int) -> None:
    """Raise :class:`APIError` (400, ``param`` the top-level field) for a string that is not
    valid Unicode, or when the strings of ``body`` hold more than ``max_chars`` characters
    in all (the field holding the most is named)."""
    chars: dict[str, int] = {}
    for name in type(body).model_fields:
        value = getattr(body, name)
        chars[name] = _chars(name, value)
    total = sum(chars.values())
    if total > max_chars:
        name = max(chars, key=chars.__getitem__)
        raise APIError(400, f"{name}: the request's text is {total} characters, over this "
                       f"server's limit of {max_chars} (--max-text-chars)", param=name)  # fmt: skip


def _chars(name: str, value: object) -> int:
    """Characters of every string in ``value`` (dict keys too), walked without recursion
    (a body nests as deep as the JSON parser allows)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"{name}: a string is not valid Unicode (a lone surrogate "
                               f"{item[e.start]!a} at character {e.start})", param=name) from None  # fmt: skip
            total += len(item)
        elif isinstance(item, BaseModel):
            stack.extend(getattr(item, f) for f in type(item).model_fields)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total
