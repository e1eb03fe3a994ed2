import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from pipeline.demo import tokenizer as st
from pipeline.demo.sudoku import (
    PuzzleError,
    augment,
    augment_batch,
    constraint_valid,
    count_solutions,
    format_grid,
    generate_puzzle,
    is_valid_solution,
    make_dataset,
    parse_puzzle,
    random_solution,
    solve,
)

# Wikipedia's example puzzle and its published solution.
WIKI = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"
WIKI_SOL = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
# Arto Inkala's "world's hardest" puzzle and its published solution.
HARD = "8..........36......7..9.2...5...7.......457.....1...3...1....68..85...1..9....4.."
HARD_SOL = "812753649943682175675491283154237896369845721287169534521974368438526917796318452"


def givens(p: str) -> int:
    return sum(ch != "." for ch in p)


def to_int(s: str) -> list[int]:
    return [0 if ch == "." else int(ch) for ch in s]


def test_solve_known_puzzles():
    assert solve(WIKI) == WIKI_SOL
    assert solve(HARD) == HARD_SOL
    assert solve(to_int(WIKI)) == WIKI_SOL
    assert count_solutions(WIKI) == 1 and count_solutions(HARD) == 1


def test_count_solutions_limits_and_contradictions():
    assert count_solutions("." * 81, limit=5) == 5
    assert count_solutions("." * 81) == 2
    sol = WIKI_SOL
    assert count_solutions(sol) == 1 and solve(sol) == sol
    bad = "55" + "." * 79
    assert count_solutions(to_int(bad)) == 0 and solve(to_int(bad)) is None


def test_random_solution_valid_and_varied():
    rng = random.Random(0)
    grids = {random_solution(rng) for _ in range(20)}
    assert len(grids) == 20 and all(constraint_valid(g) for g in grids)


@pytest.mark.parametrize("n_givens", [81, 60, 45, 30, 25])
def test_generate_exact_givens_unique(n_givens):
    rng = random.Random(n_givens)
    for _ in range(3):
        puzzle, solution = generate_puzzle(rng, n_givens)
        assert len(puzzle) == 81 and givens(puzzle) == n_givens
        assert count_solutions(puzzle, limit=2) == 1
        assert solve(puzzle) == solution
        assert is_valid_solution(puzzle, solution)


def test_generate_rejects_bad_givens():
    with pytest.raises(ValueError):
        generate_puzzle(random.Random(0), 16)


def test_make_dataset_deterministic():
    a = make_dataset(7, 20, (30, 40))
    assert a == make_dataset(7, 20, (30, 40))
    assert a != make_dataset(8, 20, (30, 40))
    counts = [givens(p) for p, _ in a]
    assert all(30 <= c <= 40 for c in counts) and len(set(counts)) > 3
    assert all(count_solutions(p) == 1 and solve(p) == s for p, s in a)


def test_augment_preserves_validity_and_changes_grid():
    rng = random.Random(3)
    for _ in range(20):
        p, s = augment(WIKI, WIKI_SOL, rng)
        assert constraint_valid(s) and is_valid_solution(p, s)
        assert givens(p) == givens(WIKI) and count_solutions(p) == 1 and solve(p) == s
        assert p != WIKI and s != WIKI_SOL


def test_augment_batch():
    rng = random.Random(5)
    pairs = [generate_puzzle(rng, 35) for _ in range(16)]
    P = np.array([to_int(p) for p, _ in pairs], dtype=np.int8)
    S = np.array([to_int(s) for _, s in pairs], dtype=np.int8)
    P2, S2 = augment_batch(P, S, np.random.default_rng(0))
    assert P2.shape == P.shape and P2.dtype == np.int8 and S2.dtype == np.int8
    assert (P2 != P).any(axis=1).all() and (S2 != S).any(axis=1).all()
    for p, s in zip(P2, S2, strict=True):
        assert constraint_valid(s.tolist()) and is_valid_solution(p.tolist(), s.tolist())
        assert (p != 0).sum() == 35 and solve(p.tolist()) == "".join(map(str, s))
    # independent transforms per example: identical inputs give different outputs
    same = np.repeat(S[:1], 8, axis=0)
    _, out = augment_batch(same, same, np.random.default_rng(1))
    assert len({r.tobytes() for r in out}) == 8


def test_parse_puzzle_forms():
    assert parse_puzzle(WIKI) == WIKI
    assert parse_puzzle(WIKI.replace(".", "0")) == WIKI
    nine_lines = "\n".join(WIKI[r * 9 : r * 9 + 9] for r in range(9)) + "\n"
    assert parse_puzzle(nine_lines) == WIKI
    assert parse_puzzle("  " + " ".join(WIKI) + "\n") == WIKI


def test_parse_puzzle_errors():
    with pytest.raises(PuzzleError, match=r"wrong length: found 80 cells, expected 81"):
        parse_puzzle(WIKI[:80])
    with pytest.raises(PuzzleError, match=r"invalid character 'x' at position 3 \(row 1, column 3\)"):
        parse_puzzle(WIKI[:2] + "x" + WIKI[3:])
    with pytest.raises(PuzzleError, match=r"digit 5 repeats in row 1 \(cells r1c1 and r1c4\)"):
        parse_puzzle("53.57" + WIKI[5:])
    with pytest.raises(PuzzleError, match=r"digit 4 repeats in column 1 \(cells r3c1 and r5c1\)"):
        parse_puzzle(WIKI[:18] + "4" + WIKI[19:])
    with pytest.raises(PuzzleError, match=r"digit 9 repeats in box 1"):
        parse_puzzle(WIKI[:2] + "9" + WIKI[3:])
    assert issubclass(PuzzleError, ValueError)


def test_validity_checks_and_format():
    assert constraint_valid(WIKI_SOL) and not constraint_valid(WIKI)
    assert not constraint_valid(WIKI_SOL[:80] + "1") and not constraint_valid("abc")
    assert is_valid_solution(WIKI, WIKI_SOL)
    assert not is_valid_solution(HARD, WIKI_SOL)  # valid grid, but ignores HARD's givens
    g = format_grid(WIKI).splitlines()
    assert len(g) == 11 and g[0] == "5 3 . | . 7 . | . . ." and g[3] == "------+-------+------"
    assert parse_puzzle("".join(ch for ch in format_grid(WIKI) if ch not in "|-+")) == WIKI


# ------------------------------------------------------------------------------------------ tokenizer


def test_tokenizer_vocab_ids():
    tok = st.build_tokenizer()
    assert tok.get_vocab_size() == st.VOCAB_SIZE == 24
    expected = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<unk>", "\n", " ", ".", "0"]
    expected += [*"123456789", "|", "-", ":", "=", ">"]
    assert [tok.id_to_token(i) for i in range(24)] == expected
    assert (st.PAD_ID, st.EOS_ID, st.BOS_ID, st.TURN_START_ID, st.TURN_END_ID) == (0, 1, 2, 3, 4)
    enc = tok.encode("<bos><|turn>12.0\n\n |x<turn|><eos>", add_special_tokens=False)
    assert enc.ids == [2, 3, 10, 11, 8, 9, 6, 6, 7, 19, 5, 4, 1]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "12.0\n\n |"
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<bos><|turn>12.0\n\n |<unk><turn|><eos>"


def test_prompt_target_helpers():
    prompt = st.sudoku_prompt_ids(WIKI)
    assert len(prompt) == 84 and prompt[:2] == [2, 3] and prompt[-1] == 4
    assert prompt[2:5] == [14, 12, 8]  # '5', '3', '.'
    tok = st.build_tokenizer()
    assert tok.encode("<bos><|turn>" + WIKI + "<turn|>", add_special_tokens=False).ids == prompt
    assert tok.decode(prompt, skip_special_tokens=True) == WIKI
    target = st.sudoku_target_ids(WIKI_SOL)
    assert len(target) == 82 and target[-1] == st.EOS_ID and st.decode_solution(target) == WIKI_SOL
    tmpl = st.sudoku_infill_template(WIKI)
    assert len(tmpl) == 82 and tmpl[:4] == [14, 12, -1, -1] and tmpl[-1] == -1
    # 81 cells (free exactly where the puzzle has '.'), then the end-token slot, left free
    assert all((t == -1) == (ch == ".") for t, ch in zip(tmpl[:81], WIKI, strict=True))
    assert (
        st.decode_solution([0, 5, 18, *target[3:]]) == "..9" + WIKI_SOL[3:]
        and st.decode_solution([]) == "." * 81
    )
    P, S = np.array([to_int(WIKI)], dtype=np.int8), np.array([to_int(WIKI_SOL)], dtype=np.int8)
    assert st.prompt_ids_batch(P).tolist() == [prompt] and st.prompt_ids_batch(P).shape == (1, 84)
    assert st.target_ids_batch(S).tolist() == [target]


def test_tokenizer_save_and_reload(tmp_path: Path):
    d = st.save_tokenizer(tmp_path / "tok")
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {
        p.name for p in d.iterdir()
    }
    prompt = st.sudoku_prompt_ids(WIKI)
    text = "<bos><|turn>" + WIKI + "<turn|>"
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.encode(text, add_special_tokens=False).ids == prompt

    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    assert hf(text, add_special_tokens=False)["input_ids"] == prompt
    assert hf.decode(prompt, skip_special_tokens=True) == WIKI
    auto = transformers.AutoTokenizer.from_pretrained(str(d))
    assert (auto.pad_token_id, auto.eos_token_id, auto.bos_token_id, auto.unk_token_id) == (0, 1, 2, 5)
    assert auto(text, add_special_tokens=False)["input_ids"] == prompt and len(auto) == 24
    assert auto.convert_tokens_to_ids(["<|turn>", "<turn|>"]) == [3, 4]


def test_a_text_prompt_learns_the_model_is_a_sudoku_solver():
    from pipeline.demo.prompt_format import SudokuFormat
    from pipeline.demo.sudoku import EXAMPLE_PUZZLE
    from pipeline.errors import InputError

    fmt = SudokuFormat()
    for text, detail in [("Write a poem about the sea", "invalid character 'W'"), ("123", "found 3 cells")]:
        with pytest.raises(InputError) as e:
            fmt.encode_prompt(text)
        msg = str(e.value)
        assert (
            msg.startswith("this model is a Sudoku solver and expects an 81-character puzzle: ")
            and detail in msg
        )
        assert EXAMPLE_PUZZLE in msg  # the hint shows what a prompt looks like
    with pytest.raises(InputError, match=r"^puzzle: contradictory givens: digit 5 repeats in row 1") as e:
        fmt.encode_prompt("55" + "." * 79)  # a grid whose givens clash is a puzzle: no "what am I" preamble
    assert "Sudoku solver" not in str(e.value)
