"""The embedded Sudoku model: puzzles, its tokenizer and prompt format, training and evaluation."""
