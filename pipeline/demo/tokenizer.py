"""Character-level tokenizer and prompt/canvas layout for Sudoku, shared by training and inference.

The vocabulary is fixed (ids never depend on training data) so model code can hard-code PAD/EOS/etc.
and the numpy batch helpers below can map digits to ids arithmetically (digit d -> id 9 + d).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "TURN_END_ID",
    "TURN_START_ID",
    "UNK_ID",
    "VOCAB",
    "VOCAB_SIZE",
    "build_tokenizer",
    "decode_solution",
    "prompt_ids_batch",
    "save_tokenizer",
    "sudoku_infill_template",
    "sudoku_prompt_ids",
    "sudoku_target_ids",
    "target_ids_batch",
]

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<unk>"]
VOCAB: list[str] = [*SPECIAL_TOKENS, "\n", " ", ".", "0", *"123456789", "|", "-", ":", "=", ">"]
VOCAB_SIZE = 24
PAD_ID, EOS_ID, BOS_ID, TURN_START_ID, TURN_END_ID, UNK_ID = range(6)
DOT_ID = 8
DIGIT0_ID = 9  # id of '0'; digit d in 1..9 has id DIGIT0_ID + d
PROMPT_LEN, TARGET_LEN = 84, 82
assert len(VOCAB) == VOCAB_SIZE

_ID = {t: i for i, t in enumerate(VOCAB)}
# int cell value (0 = blank) -> token id, for the vectorised helpers
_CELL_LUT = np.array([DOT_ID, *range(DIGIT0_ID + 1, DIGIT0_ID + 10)], dtype=np.int64)


def build_tokenizer() -> Tokenizer:
    """Every character is its own token, so a grid is exactly one token per cell."""
    tok = Tokenizer(models.WordLevel(dict(_ID), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate, don't space-join, on decode
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def save_tokenizer(directory: Path | str, model_max_length: int = 256) -> Path:
    """Write the files both `tokenizers` and `transformers.AutoTokenizer` expect to find in a checkpoint."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(d / "tokenizer.json"))
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    extra = ["<|turn>", "<turn|>"]
    config = {
        **special,
        "additional_special_tokens": extra,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (d / "special_tokens_map.json").write_text(
        json.dumps({**special, "additional_special_tokens": extra}, indent=2) + "\n"
    )
    return d


def _cell_ids(grid: str) -> list[int]:
    if len(grid) != 81:
        raise ValueError(f"expected 81 cells, got {len(grid)}")
    return [DOT_ID if ch in ".0" else _ID.get(ch, UNK_ID) for ch in grid]


def sudoku_prompt_ids(puzzle: str) -> list[int]:
    """Conditioning prefix: one chat-style turn holding the puzzle (84 tokens)."""
    return [BOS_ID, TURN_START_ID, *_cell_ids(puzzle), TURN_END_ID]


def sudoku_target_ids(solution: str) -> list[int]:
    """The diffusion canvas: 81 solution digits then EOS (82 tokens)."""
    return [*_cell_ids(solution), EOS_ID]


def sudoku_infill_template(puzzle: str) -> list[int]:
    """Canvas with givens pinned and -1 where the model must fill in (blanks and the EOS slot)."""
    return [-1 if i == DOT_ID else i for i in _cell_ids(puzzle)] + [-1]


def decode_solution(ids: Sequence[int]) -> str:
    """Read a generated canvas positionally: first 81 positions, non-digit ids become '.' (scored wrong)."""
    out = [str(int(t) - DIGIT0_ID) if DIGIT0_ID < int(t) <= DIGIT0_ID + 9 else "." for t in list(ids)[:81]]
    return "".join(out).ljust(81, ".")


def prompt_ids_batch(puzzles_int: np.ndarray) -> np.ndarray:
    """(N, 81) ints with 0 = blank -> (N, 84) int64 prompt ids; same layout as `sudoku_prompt_ids`."""
    cells = _CELL_LUT[np.asarray(puzzles_int, dtype=np.intp)]
    n = cells.shape[0]
    head = np.tile(np.array([BOS_ID, TURN_START_ID], dtype=np.int64), (n, 1))
    return np.concatenate([head, cells, np.full((n, 1), TURN_END_ID, dtype=np.int64)], axis=1)


def target_ids_batch(solutions_int: np.ndarray) -> np.ndarray:
    """(N, 81) ints 1..9 -> (N, 82) int64 canvas ids; same layout as `sudoku_target_ids`."""
    cells = _CELL_LUT[np.asarray(solutions_int, dtype=np.intp)]
    return np.concatenate([cells, np.full((cells.shape[0], 1), EOS_ID, dtype=np.int64)], axis=1)
