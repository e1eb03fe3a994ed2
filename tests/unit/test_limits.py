"""The rules derived from the caps (`pipeline.limits`) at their boundaries: the engine's room for a canvas
after the longest prompt, whether max_tokens fits the context and the exact value the hint suggests, and the
request-body bound that a prompt at its byte cap fits in any JSON escaping."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import DgpipeError
from pipeline.limits import DEFAULTS, Limits, context_length, request_bytes_limit


def test_an_engine_holds_exactly_one_canvas_after_the_longest_prompt():
    """--max-context must hold the longest prompt and one canvas: one token less is refused with the
    smallest value that works; that value itself is accepted (a build must not refuse a valid minimum)."""
    with pytest.raises(DgpipeError) as e:
        Limits(max_prompt=100, max_context=355).validate(256)
    assert str(e.value) == (
        "--max-context 355 leaves no room for a 256-token canvas after a 100-token prompt "
        "(use --max-context >= 356)"
    )
    Limits(max_prompt=100, max_context=356).validate(256)


def test_max_tokens_fits_the_context_up_to_the_last_token():
    """check_fits needs prompt + max_tokens + two canvases (context_length): a context of exactly that many
    tokens builds, one short of it is refused before any stage runs."""
    limits = Limits(max_prompt=100, max_tokens=300, max_context=100 + 300 + 2 * 256)
    assert context_length(100, 300, 256) == limits.max_context
    limits.check_fits(256)
    short = Limits(max_prompt=100, max_tokens=301, max_context=100 + 300 + 2 * 256)
    with pytest.raises(DgpipeError, match="--max-tokens 301 after a 100-token prompt needs a 913-token"):
        short.check_fits(256)


def test_the_max_tokens_hint_names_the_largest_value_that_fits():
    """The refusal's hint suggests the largest --max-tokens the engines hold; taking it must then build,
    and one more must not (a hint that is off by a canvas sends the user round again)."""
    with pytest.raises(DgpipeError) as e:
        Limits(max_prompt=100, max_tokens=600, max_context=1000).check_fits(256)
    assert e.value.hint == "use --max-tokens <= 388, a shorter --max-prompt, or --max-context >= 1212"
    Limits(max_prompt=100, max_tokens=388, max_context=1000).check_fits(256)
    with pytest.raises(DgpipeError):
        Limits(max_prompt=100, max_tokens=389, max_context=1000).check_fits(256)


def test_a_prompt_at_its_byte_cap_fits_the_request_body_bound_however_it_is_escaped():
    """JSON spells a control character in 6 bytes (\\u0001): a prompt of max_prompt_bytes control characters,
    which the prompt cap admits, must not be refused as a too-large body (a 413) before its own check runs.
    At the default cap the escaped prompt alone is 6 MiB; the bound leaves the rest of the request room."""
    cap = DEFAULTS.max_prompt_bytes
    body = json.dumps({"model": "m", "prompt": "\x01" * cap, "max_tokens": 16}).encode()
    assert len(body) > 6 * cap
    assert len(body) <= request_bytes_limit(cap)
    messages = json.dumps([{"role": "user", "content": "\x1f" * cap}]).encode()
    assert len(messages) <= request_bytes_limit(cap)
    assert request_bytes_limit(cap) == 6 * cap + (1 << 20)
    # no character's escaped form is over 6 bytes per UTF-8 byte (ASCII escapes, non-ASCII as \\uXXXX pairs)
    for c in ("\x00", "\x1f", '"', "\\", "\x7f", "é", "\u2028", "\uffff", "\U0001f600"):
        assert len(json.dumps(c)) - 2 <= 6 * len(c.encode())
