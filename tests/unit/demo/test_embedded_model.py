"""The shipped Sudoku model: it is the default everywhere, it solves puzzles, transformers loads it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pipeline.demo import sudoku
from pipeline.demo import tokenizer as stok
from pipeline.demo.evaluate import eval_sudoku
from pipeline.resources import EMBEDDED_MODEL
from pipeline.runtime.session import load_session


@pytest.fixture(scope="module")
def session():
    return load_session()  # no --model: the embedded one


def test_is_small_package_data():
    size = sum(f.stat().st_size for f in EMBEDDED_MODEL.iterdir())
    assert size <= 25 * 2**20
    meta = json.loads((EMBEDDED_MODEL / "dgpipe.json").read_text())
    assert meta["task"] == "sudoku" and "givens_range" in meta


def test_solves_held_out_puzzles(session):
    lo, hi = session.checkpoint.dgpipe["givens_range"]
    rep = eval_sudoku(
        session.model, sudoku.make_dataset(31_337, 24, (lo, hi)), (lo, hi), session.sampler(), batch=24
    )
    # measured on 1,000 puzzles in BENCHMARKS.md; 24 puzzles leave room for sampling noise
    assert rep.solve_rate >= 0.6, rep
    assert 1 <= rep.mean_steps <= session.sampler().max_denoising_steps


def test_generate_cli_solves_the_readme_puzzle():
    puzzle = "14...9..56925.31.8835.1.927..1732.5.259.6.7.437694.28....6.4.935.3.914..92....816"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "generate", puzzle, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert sudoku.is_valid_solution(puzzle, out["text"])


@pytest.mark.slow  # one CLI process per malformed puzzle
def test_malformed_puzzles_are_refused():
    for bad, needle in [
        ("123", "wrong length"),
        ("x" * 81, "invalid character"),
        ("55" + "." * 79, "contradictory givens"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "generate", bad],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


@torch.no_grad()
def _denoise_after_prefill(model, ref, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill a puzzle prompt, then one denoise pass over a random canvas: (dgpipe, transformers) logits."""
    from transformers.cache_utils import DynamicCache

    from pipeline.model.network import canvas_positions
    from pipeline.runtime.kv_cache import KVCache, attention_masks

    puzzle, _ = sudoku.make_dataset(5, 1, (50, 50))[0]
    prompt = torch.tensor([stok.sudoku_prompt_ids(puzzle)])
    canvas = torch.randint(0, stok.VOCAB_SIZE, (1, 82), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=ref.config.get_text_config())
    ref.model.encoder(input_ids=prompt, past_key_values=cache)
    theirs = ref(decoder_input_ids=canvas, past_key_values=cache).logits
    kv = KVCache(model.cfg, 1, 256, dtype)
    slot = torch.tensor([0])
    pos = canvas_positions(kv.lengths[slot], prompt.shape[1])
    ones = torch.ones_like(pos, dtype=torch.bool)
    _, new = model.encode(prompt, pos, attention_masks(pos, ones, None, True, kv.window))
    kv.write(slot, new, pos, ones)
    past, meta = kv.read(slot)
    cpos = canvas_positions(kv.lengths[slot], 82)
    masks = attention_masks(cpos, torch.ones_like(cpos, dtype=torch.bool), meta, False, kv.window)
    return model.denoise(canvas, None, cpos, masks, past), theirs


def test_transformers_loads_it_and_agrees(session):
    """The shipped checkpoint is a real DiffusionGemma: transformers loads it and its denoise logits match,
    in float64 to rounding, in fp32 within 4x transformers' own fp32 error (tests/_utils/numerics.py)."""
    transformers = pytest.importorskip("transformers")

    from pipeline.model.checkpoint import load_model
    from tests._utils.numerics import assert_within_reference_noise, error

    transformers.utils.logging.set_verbosity_error()

    def ref(dtype):
        return transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(
            EMBEDDED_MODEL,
            dtype=dtype,
            experts_implementation="eager",  # grouped_mm has no float64 kernel
        ).eval()

    ours64, oracle = _denoise_after_prefill(
        load_model(EMBEDDED_MODEL, dtype=torch.float64)[0], ref(torch.float64), torch.float64
    )
    assert error(ours64, oracle) <= 1e-12, f"float64 rel error {error(ours64, oracle):.3e}"
    ours, theirs = _denoise_after_prefill(session.model, ref(torch.float32), torch.float32)
    assert_within_reference_noise("embedded model, denoise after prefill", ours, oracle, theirs)
