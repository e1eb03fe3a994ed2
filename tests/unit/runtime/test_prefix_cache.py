"""Prefix caching: the block store (names, longest-run lookup, LRU within a budget) and the runtime with it:
a warm request reuses the K/V of a shared prefix and produces exactly the tokens of a run with caching off."""

from __future__ import annotations

import random

import pytest
import torch

from pipeline.model.config import SamplerConfig
from pipeline.runtime.prefix_cache import PrefixCache
from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
from pipeline.runtime.session import load_session
from tests.unit.serving.test_serving_core import RecordingFactory

B = 4  # block tokens in the store tests


def kv(value: float, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = torch.full((1, B, 2), float(value), dtype=torch.float32)
    return [(t.clone(), t.clone()) for _ in range(layers)]  # 2 layers x (K, V) x 8 floats = 128 bytes


def test_names_chain_the_blocks_before():
    cache = PrefixCache(B, 1 << 20)
    a, b = cache.keys(list(range(10))), cache.keys([*range(4), 9, 9, 9, 9, 8, 8])
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # 10 tokens: 2 full blocks, the tail is not a block
    assert cache.keys([9, 9, 9, 9, *range(4, 8)])[1] != a[1]  # same block 1 tokens, other block 0


def test_lookup_returns_the_longest_cached_run_from_the_start_and_counts_it():
    cache = PrefixCache(B, 1 << 20)
    prompt = list(range(13))
    for i in (0, 1, 2):
        cache.insert(prompt, i, kv(i))
    assert [float(b.kv[0][0][0, 0, 0]) for b in cache.lookup(prompt)] == [0.0, 1.0, 2.0]
    assert [float(b.kv[0][0][0, 0, 0]) for b in cache.lookup(prompt, first=1)] == [1.0, 2.0]  # the rest
    assert len(cache.lookup([*range(8), 99, 99, 99, 99])) == 2  # diverges in block 2
    assert cache.lookup([99, *range(1, 12)]) == []
    for p in (prompt, [*range(8), 99, 99, 99, 99]):
        cache.count_prompt(p)
    assert (cache.stats.lookups, cache.stats.lookup_tokens, cache.stats.hit_tokens) == (2, 25, 28)


def test_a_name_never_stands_in_for_other_tokens():
    cache = PrefixCache(B, 1 << 20)
    cache.insert(list(range(4)), 0, kv(0))
    key = cache.keys(list(range(4)))[0]
    cache.blocks[key].tokens = (7, 7, 7, 7)  # as if two prefixes hashed alike
    assert cache.lookup(list(range(4))) == []


def test_lru_within_the_budget_evicts_leaves_before_their_ancestors():
    cache = PrefixCache(B, 4 * 128)  # room for four 128-byte blocks
    chain = list(range(12))
    for i in range(3):
        cache.insert(chain, i, kv(i))
    other = [50, 51, 52, 53]
    cache.insert(other, 0, kv(9))
    assert cache.nbytes == 4 * 128
    cache.insert([60, 61, 62, 63], 0, kv(8))  # a fifth block: the least recent leaf goes
    assert cache.stats.evicted_blocks == 1 and cache.nbytes == 4 * 128
    assert len(cache.lookup(chain)) == 2  # the chain's deepest block went, its root and middle stayed
    cache.insert([70, 71, 72, 73], 0, kv(7))
    assert len(cache.lookup(chain)) == 2 and cache.lookup(other) == []  # then the oldest other block
    small = PrefixCache(B, 100)
    small.insert(chain, 0, kv(0))  # a block over the whole budget is not kept
    assert small.nbytes == 0 and not small.blocks


def test_only_full_blocks_are_named():
    """A prompt's tail shorter than a block is never a cached block: the runtime restores a hit as a whole
    block of K/V and prefills in chunks ending at block boundaries, so a named partial tail would hand a
    later prompt K/V for positions it never computed. n tokens name exactly n // block blocks, the names of
    the prompt cut to those blocks."""
    cache = PrefixCache(B, 1 << 20)
    for n in range(14):
        assert len(cache.keys(list(range(n)))) == n // B, n
    assert cache.keys(list(range(11))) == cache.keys(list(range(8)))


def test_a_lookup_keeps_the_chains_root_the_most_recent():
    """A lookup marks its chain used root last: the next eviction takes the chain's deepest block, so the
    root (shared by every prompt with that system prompt) stays and later prompts still hit it."""
    cache = PrefixCache(B, 3 * 128)  # room for three blocks
    chain = list(range(12))
    for i in range(3):
        cache.insert(chain, i, kv(i))
    assert len(cache.lookup(chain)) == 3
    cache.insert([50, 51, 52, 53], 0, kv(9))  # the budget is full: one block of the chain goes
    assert [float(b.kv[0][0][0, 0, 0]) for b in cache.lookup(chain)] == [0.0, 1.0]


def test_a_lookup_from_a_later_block_refreshes_the_blocks_before_it():
    """lookup(first=k) (a prompt prefilled block by block) reads only blocks k.., but the blocks before it are
    the same prefix: they are marked used too, else the hit would leave its own ancestors to be evicted first
    and the next request would miss the whole chain."""
    cache = PrefixCache(B, 3 * 128)
    chain = list(range(8))
    cache.insert(chain, 0, kv(0))
    cache.insert(chain, 1, kv(1))
    cache.insert([50, 51, 52, 53], 0, kv(9))  # now the least recent: the chain's two blocks
    assert len(cache.lookup(chain, first=1)) == 1
    cache.insert([60, 61, 62, 63], 0, kv(8))  # evicts the [50..] block, not the chain's root
    assert len(cache.lookup(chain)) == 2 and cache.lookup([50, 51, 52, 53]) == []


# ---- the runtime with the cache -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def session():
    from pipeline.resources import EMBEDDED_MODEL

    return load_session(EMBEDDED_MODEL)


def prompts(n: int, shared: int, own: int) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(5, 24) for _ in range(shared)]
    return [prefix + [rng.randrange(5, 24) for _ in range(own)] for _ in range(n)]


def run(session, ps: list[list[int]], mib: int, together: bool = False, cached: list | None = None):
    """(runtime, each prompt's tokens); `cached` gets each request's prompt tokens the cache supplied."""
    rt = BlockDiffusionRuntime(session.model, max_batch=len(ps), max_len=512, prefix_cache_mib=mib)
    reqs = [
        Request(p, max_tokens=20, seed=i, request_id=i, sampler=SamplerConfig(max_denoising_steps=3))
        for i, p in enumerate(ps)
    ]
    results = rt.generate(reqs) if together else [rt.generate([r])[0] for r in reqs]
    if cached is not None:
        cached += [r.cached_tokens for r in results]
    return rt, [r.tokens for r in results]


def test_warm_requests_reuse_the_shared_prefix_and_return_the_cold_tokens(session):
    """Prompts of 300 tokens sharing their first 280 (one 256-token block), one after another."""
    ps = prompts(4, 280, 20)
    hits, misses = [], []
    warm, on = run(session, ps, mib=64, cached=hits)
    cold, off = run(session, ps, mib=0, cached=misses)
    assert on == off and all(on)
    assert hits == [0, 256, 256, 256] and misses == [0] * 4  # each request's own (OpenAI's cached_tokens)
    assert warm.prefill_chunk == 256 and warm.prefix_cache is not None and cold.prefix_cache is None
    stats = warm.prefix_cache.stats
    assert (stats.lookups, stats.hit_tokens, stats.inserted_blocks) == (4, 3 * 256, 1)
    # cold: each prompt in two chunks (256 + 44 tokens); warm: the first so, then only the 44-token chunk
    assert (cold.passes["prefill"], warm.passes["prefill"], warm.passes["prefix_hit"]) == (8, 5, 3)


def test_a_prompt_cached_whole_needs_no_prefill_and_batched_prompts_match_alone(session):
    ps = prompts(3, 256, 0)  # exactly one block: the warm ones restore it all
    warm, on = run(session, ps, mib=64)
    _, off = run(session, ps, mib=0)
    assert on == off and warm.passes["prefill"] == 1
    mixed = prompts(3, 280, 20)
    _, alone = run(session, mixed, mib=0)
    hits = []
    batched, together = run(session, mixed, mib=64, together=True, cached=hits)
    assert together == alone and sorted(hits) == [0, 256, 256]
    # admitted together: one row computes the shared block, the other two copy it in on the next turn
    assert batched.prefix_cache.stats.hit_tokens == 2 * 256 and batched.passes["prefill"] == 2


def test_after_a_failed_step_a_prompt_restored_whole_denoises_in_a_round_of_its_own(session):
    """After a failed step the server drops the requests in the batch (`drop_running`); the next one in the same slot, its
    prompt restored whole from the cache (no prefill pass), gets positions, masks and past of its own, not the
    dropped request's."""
    (cached,), dropped = prompts(1, 256, 0), [5 + i % 19 for i in range(310)]  # another prompt, longer
    _, (cold,) = run(session, [cached], mib=0)
    rt = BlockDiffusionRuntime(session.model, max_batch=1, max_len=512, prefix_cache_mib=64)
    request = lambda p, i: Request(
        p, max_tokens=20, seed=0, request_id=i, sampler=SamplerConfig(max_denoising_steps=3)
    )
    rt.generate([request(cached, 0)])  # puts its block in the cache
    rt.submit(request(dropped, 1))
    rt.step()  # a round for the dropped request's positions
    assert rt.busy() and len(rt.drop_running()) == 1 and not rt.busy()
    (warm,) = rt.generate([request(cached, 0)])
    assert rt.prefix_cache.stats.hit_tokens == 256 and warm.tokens == cold


def test_a_budget_too_small_for_a_block_only_costs_the_reuse(session):
    ps = prompts(2, 280, 20)
    _, on = run(session, ps, mib=0)
    rt = BlockDiffusionRuntime(session.model, max_batch=2, max_len=512, prefix_cache_mib=64)
    rt.prefix_cache.budget_bytes = 1024  # smaller than one block of this model's K/V
    tokens = [
        rt.generate([Request(p, max_tokens=20, seed=i, request_id=i, sampler=SamplerConfig(max_denoising_steps=3))])[0].tokens
        for i, p in enumerate(ps)
    ]  # fmt: skip
    assert tokens == on and rt.prefix_cache.stats.hit_tokens == 0 and not rt.prefix_cache.blocks


def test_metrics_follow_the_cache_counts():
    from pipeline.serving.core.metrics import Metrics

    m = Metrics(RecordingFactory())
    cache = PrefixCache(B, 1 << 20)
    cache.insert(list(range(8)), 0, kv(0))
    cache.count_prompt(list(range(8)))
    cache.lookup(list(range(8)))
    m.record_prefix_cache(cache)
    cache.count_prompt(list(range(8)))
    cache.lookup(list(range(8)))
    m.record_prefix_cache(cache)
    m.record_prefix_cache(cache)  # nothing new: nothing added
    assert (m.prefix_lookup_tokens.value, m.prefix_hit_tokens.value, m.prefix_bytes.value) == (16, 8, 128)
