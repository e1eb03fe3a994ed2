"""Log-probability entries of returned tokens, in the shape OpenAI's chat API gives them
(`choices[].logprobs.content[]`: https://platform.openai.com/docs/api-reference/chat/object): per token its
text, its log-probability, its UTF-8 bytes and its most probable alternatives, each with the same fields.

The numbers come from the runtime (`Result.logprobs`: each committed token's log-probability under the
distribution of the denoise pass that committed it, or for a constrained request the masked distribution it
was decoded from, README "logprobs"). A token's text is what it adds to the
answer (the checkpoint's decode of it alone); its bytes are its own bytes, which differ from the text's for
a byte-fallback token (`<0xE2>`: one byte of a character the text shows only once its other bytes follow).
A log-probability of -inf (a token given no mass) is reported as LOGPROB_FLOOR: JSON has no infinity (nor
NaN, which a broken checkpoint's logits would give: reported likewise).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pipeline.limits import LOGPROB_FLOOR

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


class TokenTexts:
    """Each token id's (text, bytes), computed once per id."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self.cache:
            text = self.session.decode([token])
            tokenizer = self.session.tokenizer
            piece = tokenizer.id_to_token(token) if tokenizer is not None else None
            byte = BYTE_TOKEN.fullmatch(piece) if piece else None
            self.cache[token] = (text, [int(byte.group(1), 16)] if byte else list(text.encode("utf-8")))
        return self.cache[token]


def token_entries(
    texts: TokenTexts, tokens: Sequence[int], records: Sequence[tuple[float, list[tuple[int, float]]]]
) -> list[dict[str, Any]]:
    """The entries of `tokens`, from their runtime records (log p, [(alternative, log p), ...])."""
    out = []
    for token, (lp, top) in zip(tokens, records, strict=True):
        entry: dict[str, Any] = _entry(texts, token, lp)
        entry["top_logprobs"] = [_entry(texts, t, v) for t, v in top]
        out.append(entry)
    return out


def _entry(texts: TokenTexts, token: int, lp: float) -> dict[str, Any]:
    text, raw = texts(token)
    # `lp >= floor` is False for NaN too: no mass, or none that can be said, is the floor (JSON has neither)
    return {"token": text, "logprob": lp if lp >= LOGPROB_FLOOR else LOGPROB_FLOOR, "bytes": raw}
