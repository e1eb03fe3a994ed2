"""A request's output text across canvases: whole characters, stop words never shown in part, usage counted
on the text returned."""

from __future__ import annotations

import pytest

from pipeline.runtime.output_text import OutputText, ready_text, tokens_covering


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def byte_fallback_decode():
    """A SentencePiece-style BPE with byte fallback, as Gemma's tokenizer is, built by HF `tokenizers`: a
    character outside the vocabulary is spelled by `<0xNN>` tokens, which its decoder joins back into
    UTF-8 (and decodes to U+FFFD while incomplete)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "a": 257, "b": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tok


def test_a_character_whose_bytes_straddle_two_canvases_comes_out_whole():
    tok = byte_fallback_decode()
    ids = tok.encode("ab😀ab").ids
    assert len(ids) == 8 and tok.decode(ids[:4]).endswith("\ufffd")  # a, b and two of the emoji's 4 bytes
    out = OutputText(lambda t: tok.decode(list(t)))
    assert out.add(ids[:4]) == "ab"  # the incomplete character is held back, not sent as U+FFFD
    assert out.add(ids[4:]) == "😀ab"
    assert out.finish() == "" and out.text == "ab😀ab" and not out.stopped


def test_a_stop_word_is_never_shown_in_part():
    out = OutputText(decode, ["END"])
    assert out.add(chars("abcE")) == "abc"  # "E" may begin the stop word: held
    assert out.add(chars("NDxyz")) == "" and out.stopped and out.text == "abc"
    assert out.finish() == ""


def test_a_held_tail_that_begins_no_stop_word_after_all_is_shown():
    out = OutputText(decode, ["END", "\n\nUser:"])
    assert out.add(chars("one\n")) == "one"
    assert out.add(chars("\nUs")) == ""  # "\n\nUs" still begins "\n\nUser:"
    assert out.add(chars("ed")) == "\n\nUsed"
    assert out.add(chars("EN")) == "" and out.finish() == "EN" and out.text == "one\n\nUsedEN"


@pytest.mark.parametrize(
    ("whole", "stop", "final", "expected"),
    [
        ("hello world", ["wor"], False, ("hello ", True)),  # cut before the first stop word
        ("abXcd", ["cd", "X"], False, ("ab", True)),  # the earliest of several
        ("abcdo", ["or"], False, ("abcd", False)),  # "o" begins "or"
        ("abcdwo", ["or", "wor"], False, ("abcd", False)),  # the longest tail that begins one
        ("abcdwo", ["wor"], True, ("abcdwo", False)),  # the output ended: nothing is held
        ("ab\ufffd\ufffd", [], False, ("ab", False)),  # an incomplete character
        ("ab\ufffd\ufffd", [], True, ("ab\ufffd\ufffd", False)),  # ...which the end leaves as it is
    ],
)
def test_ready_text(whole, stop, final, expected):
    assert ready_text(whole, stop, final) == expected


def test_usage_counts_the_tokens_of_the_text_returned():
    words = {1: "Hello", 2: " wor", 3: "ld", 4: "!"}
    spell = lambda ids: "".join(words[t] for t in ids)
    assert tokens_covering(spell, [1, 2, 3, 4], len("Hello wo")) == 2  # the token the cut falls in counts
    assert tokens_covering(spell, [1, 2, 3, 4], len("Hello")) == 1
    assert tokens_covering(spell, [1, 2, 3, 4], 0) == 0
    assert tokens_covering(spell, [1, 2, 3, 4], 0, start=2) == 2  # never fewer than `start`
    out = OutputText(spell, ["ld"])
    out.add([1, 2])
    out.add([3, 4])
    assert out.stopped and out.text == "Hello wor" and out.ids == [1, 2]


def test_generate_streams_a_character_split_between_canvases_whole():
    """`dgpipe generate --stream`'s request callbacks: each canvas's new text, the held-back tail at the
    end, and together the answer as one decoding reads it."""
    import types

    from pipeline.runtime.batch import Callbacks, GenerateInput, GenerateSettings, _request

    tok = byte_fallback_decode()
    ids = tok.encode("ab😀ab").ids
    session = types.SimpleNamespace(
        encode_prompt=lambda prompt: [257],
        default_template=lambda prompt: None,
        decode=lambda t: tok.decode(list(t)),
    )
    pieces: list[str] = []
    done: list[bool] = []
    cb = Callbacks(on_piece=pieces.append, on_done=lambda: done.append(True))
    req = _request(session, GenerateInput("a"), GenerateSettings(stream=True), None, None, cb)
    req.on_canvas(req, ids[:3])  # the emoji's first byte ends the canvas
    req.on_canvas(req, ids[3:])
    req.on_finish(None)
    assert pieces == ["ab", "😀ab"] and done == [True]


def test_a_stop_word_right_after_a_split_character_counts_all_of_its_bytes():
    tok = byte_fallback_decode()
    ids = tok.encode("bb😀ab").ids  # b, b, the emoji's 4 byte tokens, a, b
    out = OutputText(lambda t: tok.decode(list(t)), ["ab"])
    assert out.add(ids[:4]) == "bb"
    assert out.add(ids[4:]) == "😀" and out.stopped
    # "bb😀" returned: the emoji's four byte tokens all count, not the first three of them
    assert out.text == "bb😀" and out.ids == ids[:6]
