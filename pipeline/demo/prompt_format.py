"""The Sudoku prompt format: a puzzle as text -> the demo model's prompt, its givens pinned in the canvas,
and the canvas read back as 81 digits. Checkpoints with `"task": "sudoku"` (or `"prompt_format": "sudoku"`)
in dgpipe.json get it through `pipeline.runtime.prompt_format`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.demo import sudoku
from pipeline.demo import tokenizer as stok
from pipeline.errors import InputError
from pipeline.runtime.chat_template import Message, last_user_text

PUZZLE_EXAMPLE = f"for example {sudoku.EXAMPLE_PUZZLE}"


def _puzzle(text: str) -> str:
    """The puzzle, or an error that says what this model is when the prompt is not a grid at all
    (a chat prompt sent to the default model should learn it is a Sudoku solver, not a character index)."""
    try:
        return sudoku.parse_puzzle(text)
    except sudoku.PuzzleFormatError as e:
        raise InputError(
            f"this model is a Sudoku solver and expects an 81-character puzzle: {e}", PUZZLE_EXAMPLE
        ) from e
    except sudoku.PuzzleError as e:
        raise InputError(f"puzzle: {e}") from e


class SudokuFormat:
    needs_tokenizer = False  # the demo vocabulary is fixed: puzzles are encoded without tokenizer.json
    example_prompt = sudoku.EXAMPLE_PUZZLE
    smoke_prompt = sudoku.EXAMPLE_PUZZLE
    smoke_check = "a valid Sudoku solution of the puzzle (81 digits that keep its givens)"

    def __init__(self, checkpoint: Any = None, tokenizer: Any = None) -> None:
        pass

    def encode_prompt(self, text: str) -> list[int]:
        return stok.sudoku_prompt_ids(_puzzle(text))

    def encode_messages(self, messages: list[Message]) -> list[int]:
        """The demo model has no chat template: the last user message is the puzzle."""
        return self.encode_prompt(last_user_text(messages))

    def infill_template(self, text: str) -> list[int] | None:
        return stok.sudoku_infill_template(_puzzle(text))

    def decode(self, tokens: Sequence[int]) -> str:
        return stok.decode_solution(tokens)

    def decode_prompt(self, prompt_ids: Sequence[int]) -> str:
        """The puzzle the prompt holds (its 81 cells between the turn tokens), '.' for a blank."""
        return stok.decode_solution(list(prompt_ids)[2:-1])

    def present(self, prompt: str, text: str) -> tuple[str, str | None]:
        solved = sudoku.is_valid_solution(_puzzle(prompt), text)
        return sudoku.format_grid(text), "solved" if solved else "NOT a valid solution"

    @staticmethod
    def check_answer(prompt: str, text: str) -> str | None:
        if sudoku.is_valid_solution(_puzzle(prompt), text.strip()):
            return None
        return f"not a valid solution of the puzzle: {text.strip()[:100]!r}"
