"""The Sudoku prompt format: a puzzle as text -> the demo model's prompt, its givens pinned in the canvas,
and the canvas read back as 81 digits. Checkpoints with `"task": "sudoku"` (or `"prompt_format": "sudoku"`)
in dgpipe.json get it through `pipeline.runtime.prompt_format` (registered under the `dgpipe.prompt_formats`
entry point in pyproject.toml). It also carries the task's data and judgement: the calibration puzzles of
`dgpipe quantize`, the held-out puzzles and solve-rate evaluation of `dgpipe eval quantization`, and the
deploy smoke test's puzzle and check, all in the checkpoint's givens band."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipeline.demo import sudoku
from pipeline.demo import tokenizer as stok
from pipeline.demo.evaluate import eval_sudoku
from pipeline.errors import InputError
from pipeline.runtime.chat_template import Message, last_user_text
from pipeline.runtime.prompt_format import Accuracy, EncodedPrompt, Example

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
        meta = checkpoint.dgpipe if checkpoint is not None else {}
        lo, hi = meta.get("givens_range", sudoku.DEFAULT_GIVENS)
        self.givens = (int(lo), int(hi))  # the band the checkpoint was trained on

    def calibration_prompts(self, n: int, seed: int) -> list[EncodedPrompt]:
        """Puzzles of the checkpoint's givens band with their givens pinned, as they are served."""
        return [
            EncodedPrompt(stok.sudoku_prompt_ids(p), stok.sudoku_infill_template(p))
            for p, _ in sudoku.make_dataset(seed, n, self.givens)
        ]

    def evaluation_examples(self, n: int, seed: int) -> list[Example]:
        return [Example(p, solution) for p, solution in sudoku.make_dataset(seed, n, self.givens)]

    def answer_ids(self, answer: str) -> list[int]:
        return stok.sudoku_target_ids(answer)

    def evaluate(
        self,
        model: Any,
        examples: list[Example],
        sampler: Any,
        progress: Callable[[int], None] | None = None,
    ) -> Accuracy:
        """Solve rate = exact match with the unique solution (`pipeline.demo.evaluate.eval_sudoku`)."""
        puzzles = [(e.prompt, e.answer) for e in examples]
        rep = eval_sudoku(model, puzzles, self.givens, sampler, batch=50, seed=0, progress=progress)
        return Accuracy(rep.solve_rate, rep.valid_rate, rep.mean_steps, rep.p90_steps, rep.tokens_per_s)

    def encode_prompt(self, text: str) -> list[int]:
        return stok.sudoku_prompt_ids(_puzzle(text))

    def encode_messages(self, messages: list[Message]) -> list[int]:
        """The demo model has no chat template: the last user message is the puzzle."""
        return self.encode_prompt(last_user_text(messages))

    def infill_template(self, text: str) -> list[int] | None:
        return stok.sudoku_infill_template(_puzzle(text))

    def decode(self, tokens: Sequence[int]) -> str:
        """One character per generated cell token, never padded: a canvas cut short (max_tokens < 81)
        reads as the cells it holds. The end tokens read as nothing, as a tokenizer's special tokens do:
        a guided output ends with one right after its text (`1` then EOS is "1", not "1.")."""
        cells = [t for t in tokens if int(t) not in (stok.EOS_ID, stok.TURN_END_ID)]
        return stok.decode_solution(cells)[: len(cells)]

    def decode_prompt(self, prompt_ids: Sequence[int]) -> str:
        """The puzzle the prompt holds (its 81 cells between the turn tokens), '.' for a blank."""
        return stok.decode_solution(list(prompt_ids)[2:-1])

    def present(self, prompt: str, text: str) -> tuple[str, str | None]:
        grid = text.ljust(81, ".")  # a grid cut short shows its missing cells blank
        solved = sudoku.is_valid_solution(_puzzle(prompt), grid)
        return sudoku.format_grid(grid), "solved" if solved else "NOT a valid solution"

    @staticmethod
    def check_answer(prompt: str, text: str) -> str | None:
        if sudoku.is_valid_solution(_puzzle(prompt), text.strip()):
            return None
        return f"not a valid solution of the puzzle: {text.strip()[:100]!r}"
