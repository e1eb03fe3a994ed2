"""Block-autoregressive diffusion generation with canvas-level continuous batching.

Each request owns a cache row ("slot"). Per scheduler step:
  1. admit waiting requests into free slots and prefill their prompts (causal passes, right-padded, in
     block-sized chunks; blocks other requests already prefilled come from the prefix cache);
  2. run ONE denoise pass over every slot that has a canvas in flight, whatever step each is at
     (temperatures and sampler settings are per row);
  3. finalise the canvases that stopped: emit the argmax block trimmed at the first end token and at
     max_tokens, then commit the untrimmed block (causal pass) for rows that continue.
A request therefore joins at a canvas boundary and shares every denoise pass with the others; its draws
are keyed by (seed, request id, canvas, step), so its output does not depend on its neighbours.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipeline.errors import InputError
from pipeline.limits import (
    DEFAULT_MAX_TOKENS,
    DEFAULTS,
    PREFILL_CHUNK_TOKENS,
    TOP_LOGPROBS_MAX,
    context_length,
)
from pipeline.model.config import SamplerConfig
from pipeline.model.network import DiffusionGemma, canvas_positions
from pipeline.runtime.backends import (
    KV,
    DenoiseResult,
    ModelBackend,
    SamplerInputs,
    TorchBackend,
    sampled_distribution,
)
from pipeline.runtime.device_errors import device_failure
from pipeline.runtime.device_loop import DenoiseRound, DeviceLoop, on_device
from pipeline.runtime.guided import (
    DecodedLogprob,
    GuideState,
    advance,
    decoded_logprob,
    finish_canvas,
    mask_rows,
)
from pipeline.runtime.kv_cache import KVCache, attention_masks, canvas_room
from pipeline.runtime.prefix_cache import PrefixCache
from pipeline.runtime.warm import warm_experts
from pipeline.sampler.constraints import TokenAutomaton
from pipeline.sampler.reference import CounterDraws, DrawSource, RowKeys, temperatures

# after a batch ran out of GPU memory, how long without another failure before one more row may run
CEILING_RECOVERY_S = 300.0


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    seed: int = 0
    request_id: int = 0
    # RNG coordinate (default: request_id); a server sets 0 so a seed alone fixes the draws
    draw_id: int | None = None
    template: list[int] | None = (
        None  # infill: token per canvas position, -1 = free (applies to every canvas)
    )
    guide: TokenAutomaton | None = None  # constrained decoding: the output must be in its language
    min_tokens: int = 0  # tokens before an end token may stop the request (max_tokens: never, ignore_eos)
    # log-probabilities wanted: None = no; k = each token's and its k most probable alternatives' (0..20)
    logprobs: int | None = None
    on_canvas: Callable[[Request, list[int]], None] | None = None
    on_draft: Callable[[Request, list[int], int], None] | None = None
    on_finish: Callable[[Result], None] | None = None


@dataclass
class Result:
    request: Request
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    steps_per_canvas: list[int] = field(default_factory=list)
    time_to_first_canvas: float = 0.0
    started: float = 0.0  # submitted
    admitted: float = 0.0  # got a slot (prefill)
    finished: float = 0.0
    cancelled: bool = False
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache supplied (not computed)
    # with Request.logprobs: one (log p(token), [(alternative, log p), ...]) per token of `tokens`
    logprobs: list[TokenLogprob] = field(default_factory=list)


# a committed token's log-probability and its k most probable alternatives (token id, log-probability),
# all from the distribution of the denoise pass whose argmax canvas was committed (see _keep_logprobs; a
# constrained token's: the masked distribution it was decoded from, see _advance_guides and decoded_logprob)
TokenLogprob = tuple[float, list[tuple[int, float]]]


def emitted_tokens(block: list[int], end_ids: set[int], floor: int, room: int) -> tuple[list[int], str]:
    """What a finished canvas adds to its request's output, and why the request stops ("" if it goes on): the
    canvas up to and including its first end token at a position >= `floor` (an end token before it is an
    ordinary token: min_tokens), cut to the `room` tokens max_tokens leaves. "stop": an end token ends the
    output; "length": max_tokens is reached."""
    first_end = next((i for i, t in enumerate(block) if t in end_ids and i >= floor), None)
    emitted = block if first_end is None else block[: first_end + 1]
    if len(emitted) > room:
        return emitted[:room], "length"
    if first_end is not None:
        return emitted, "stop"
    return emitted, "length" if len(emitted) == room else ""


class BlockDiffusionRuntime:
    """Owns the backend (model + sampler), the KV cache and the per-slot sampler state."""

    def __init__(
        self,
        model: DiffusionGemma | ModelBackend,
        max_batch: int = DEFAULTS.max_batch,
        max_len: int | None = None,
        draws: DrawSource | None = None,
        graphs: bool | None = None,
        sync_every: int | None = None,
        prefix_cache_mib: int = DEFAULTS.prefix_cache_mib,
    ) -> None:
        """`graphs`: capture each canvas round's denoise step in a CUDA graph (default: where the backend
        allows it). `sync_every`: denoise passes between host checks for finished canvases (default 4 on
        CUDA, 1 elsewhere); rows that finish in between are frozen on the device, so results never depend
        on it, only the wasted passes do. `prefix_cache_mib`: memory for the K/V of prompt blocks kept
        across requests (0: off; `pipeline.runtime.prefix_cache`)."""
        self.draws = draws or CounterDraws()
        self.backend: ModelBackend = (
            TorchBackend(model, self.draws) if isinstance(model, DiffusionGemma) else model
        )
        cfg = self.backend.config.text_config
        self.canvas_length = self.backend.config.canvas_length
        self.vocab = cfg.vocab_size
        self.end_ids = set(cfg.end_token_ids)
        self.pad_id = cfg.pad_token_id
        self.max_len = max_len or min(cfg.max_position_embeddings, DEFAULTS.max_context)
        self.max_batch = max_batch
        # rows admitted at most, below max_batch once a batch ran out of GPU memory (`after_out_of_memory`)
        self.rows_allowed = self.rows_ceiling = max_batch
        # when (perf_counter) a batch last ran out of memory, or the ceiling last rose a period after it
        self._out_of_memory_at = 0.0
        self.device, self.dtype = self.backend.device, self.backend.dtype
        # room in the cache for a canvas's K/V, where the backend writes them there (`KVCache.read`)
        room = canvas_room(self.backend, self.canvas_length)
        self.cache = KVCache(cfg, max_batch, self.max_len, self.dtype, self.device, room)
        s, length = max_batch, self.canvas_length
        dev = self.device
        self.x = torch.zeros(s, length, dtype=torch.long, device=dev)
        self.amax = torch.full((s, length), -1, dtype=torch.long, device=dev)
        self.template = torch.full((s, length), -1, dtype=torch.long, device=dev)
        # self-conditioning state: the previous step's soft embedding softmax(z) @ E * sqrt(d) per position
        # (DenoiseResult.soft), [S, L, hidden] in the model dtype; hidden, not vocab, wide: 1.4 MB per slot
        # at the 26B's sizes in bf16 (quantize.planner.Workspace.sc_state)
        self.sc = torch.zeros(s, length, cfg.hidden_size, dtype=self.dtype, device=dev)
        # whether a slot's canvas has had a step (its self-conditioning signal exists): host-side, so the
        # first step of a batch of fresh canvases can pass "no signal" and skip the self-conditioning MLP
        self.has_sc: list[bool] = [False] * s
        # constrained slots only: the last live pass's masked probabilities [L, V] (bf16), from which the
        # canvas's unaccepted rest is decoded under the exact automaton state (runtime.guided.finish_canvas)
        self.guide_probs: dict[int, torch.Tensor] = {}
        self.done = torch.zeros(s, dtype=torch.bool, device=dev)  # canvas finished, awaiting the host
        self.step_idx = torch.zeros(s, dtype=torch.long, device=dev)
        self.canvas_idx = torch.zeros(s, dtype=torch.long, device=dev)
        self.stable = torch.zeros(s, dtype=torch.long, device=dev)
        self.seed = torch.zeros(s, dtype=torch.long, device=dev)
        self.req_id = torch.zeros(s, dtype=torch.long, device=dev)
        f32 = {"dtype": torch.float32, "device": dev}
        self.n_steps = torch.ones(s, dtype=torch.long, device=dev)
        self.t_min, self.t_span = torch.ones(s, **f32), torch.zeros(s, **f32)  # span: t_max - t_min
        self.bound, self.conf = torch.ones(s, **f32), torch.zeros(s, **f32)
        self.stab_k = torch.ones(s, dtype=torch.long, device=dev)
        self.results: list[Result | None] = [None] * s
        self.guides: list[GuideState | None] = [None] * s  # constrained rows' automaton progress
        # log-probabilities per slot (rows that ask for them): the argmax token's under the latest live pass
        # (a constrained row's: under the distribution each token was decoded from), and the top
        # TOP_LOGPROBS_MAX alternatives' values and ids
        self.lp_token = torch.zeros(s, length, **f32)
        self.lp_top = torch.zeros(s, length, TOP_LOGPROBS_MAX, **f32)
        self.lp_ids = torch.zeros(s, length, TOP_LOGPROBS_MAX, dtype=torch.long, device=dev)
        self.waiting: deque[Result] = deque()
        self.passes = {"prefill": 0, "denoise": 0, "commit": 0, "prefix_hit": 0}
        # prompts are prefilled in chunks ending at multiples of this (the prefix cache's block size)
        self.prefill_chunk = PREFILL_CHUNK_TOKENS
        self.prefix_cache = (
            PrefixCache(self.prefill_chunk, prefix_cache_mib << 20) if prefix_cache_mib > 0 else None
        )
        self.loop = DeviceLoop(
            self.device, getattr(self.backend, "graph_safe", False) if graphs is None else graphs
        )
        on_gpu = self.device.type == "cuda"
        self.sync_every = sync_every or (4 if on_gpu else 1)
        self._round: DenoiseRound | None = None

    # ---- public API -----------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        if not req.prompt_ids:
            raise InputError("prompt is empty", "pass at least one token")
        if req.max_tokens < 1:
            raise InputError(f"max_tokens must be >= 1 (got {req.max_tokens})")
        if len(req.prompt_ids) + self.canvas_length > self.max_len:
            raise InputError(
                f"prompt has {len(req.prompt_ids)} tokens; with one {self.canvas_length}-token canvas it exceeds "
                f"the context limit of {self.max_len} tokens",
                "shorten the prompt; a server's context limit is its --max-context",
            )
        if any(t < 0 or t >= self.vocab for t in req.prompt_ids):
            raise InputError(f"prompt holds token ids outside the vocabulary [0, {self.vocab})")
        if req.logprobs is not None:
            if not 0 <= req.logprobs <= TOP_LOGPROBS_MAX:
                raise InputError(f"top logprobs must be in [0, {TOP_LOGPROBS_MAX}] (got {req.logprobs})")
            if not getattr(self.backend, "returns_probs", False):
                raise InputError(
                    f"log-probabilities need the sampler's probabilities, which the {type(self.backend).__name__} "
                    "keeps inside its graph",
                    "serve the model with the PyTorch backend to get logprobs",
                )
        if req.template is not None:
            if len(req.template) > self.canvas_length:
                raise InputError(
                    f"infill template has {len(req.template)} positions > canvas {self.canvas_length}"
                )
            if any(t >= self.vocab or t < -1 for t in req.template):
                raise InputError("infill template holds token ids outside the vocabulary")
        if req.guide is not None:
            room = self.guide_room(req)
            if req.guide.min_tokens > room:
                raise InputError(
                    f"the {req.guide.spec.kind} guide needs at least {req.guide.min_tokens} tokens (end token "
                    f"included) but the request may emit only {room}",
                    "raise max_tokens or shorten the prompt",
                )

    def guide_room(self, req: Request) -> int:
        """Tokens a request may emit: max_tokens, and the whole canvases its context still holds."""
        canvases = (self.max_len - len(req.prompt_ids)) // self.canvas_length
        return min(req.max_tokens, canvases * self.canvas_length)

    def submit(self, req: Request) -> Result:
        self.validate(req)
        res = Result(request=req, started=time.perf_counter())
        self.waiting.append(res)
        return res

    def cancel(self, request_id: int) -> None:
        for res in list(self.waiting) + [r for r in self.results if r is not None]:
            if res.request.request_id == request_id:
                res.cancelled = True

    def drop_all(self) -> list[Result]:
        """Forget every request without callbacks (the server answers them itself: shutting down)."""
        dropped = [*self.waiting, *self.drop_running()]
        self.waiting.clear()
        return dropped

    def drop_running(self) -> list[Result]:
        """Forget the requests in the batch without callbacks, after a failed step (the server answers
        them itself); those still waiting for a slot stay queued."""
        dropped = [r for r in self.results if r is not None]
        self.results = [None] * self.max_batch
        self.guides = [None] * self.max_batch
        self.guide_probs.clear()  # a view of a pass's probabilities pins the whole batch's
        self._round = None  # the dropped rows' positions, masks and past
        return dropped

    def busy(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.results)

    def warm_kernels(self) -> list[int]:
        """Compile, before serving, the Triton kernels that this runtime's first passes of new sizes would
        compile mid-request (`pipeline.runtime.warm`): the experts' GEMM paths of every pass it can run, up
        to `max_batch` rows of a canvas or of a prefill chunk. Returns the token counts of the passes run:
        none off CUDA or on another backend than the PyTorch model."""
        if not isinstance(self.backend, TorchBackend):
            return []
        most = self.max_batch * max(self.canvas_length, self.prefill_chunk)
        with on_device(self.device):
            return warm_experts(self.backend.model, self.device, most)

    @torch.no_grad()
    def generate(self, requests: list[Request]) -> list[Result]:
        """Run requests to completion (in-process path). Each gets its own result, in order."""
        results = [self.submit(r) for r in requests]
        while self.busy():
            self.step()
        return results

    @torch.no_grad()
    def step(self) -> None:
        """One turn: admit waiting requests, run the rows' denoise passes to the next host check, finish
        the canvases that are done. On this runtime's GPU whichever thread calls it (`on_device`)."""
        with on_device(self.device):
            self._drop_cancelled()
            self._admit()
            active = [i for i, r in enumerate(self.results) if r is not None]
            if not active:
                return
            done = self._denoise(torch.tensor(active, device=self.device))
            if done:
                self._finalise(done)

    # ---- scheduling -----------------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        for res in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(res)
            self._finish(res, "cancelled")
        for slot, res in enumerate(self.results):
            if res is not None and res.cancelled:
                self._release(slot, "cancelled")

    def after_out_of_memory(self, rows: int) -> None:
        """A step with `rows` rows ran out of GPU memory: admit half as many from now on, then one more row
        with every canvas that finishes, up to one row fewer than failed (the ceiling). So the server learns
        the batch that fits its memory (`dgpipe quantize --estimate` plans it beforehand). Memory can also
        run out for a reason the batch size is not (one long prompt, fragmentation), so the ceiling rises by
        one row every `CEILING_RECOVERY_S` without another failure, back to max_batch (both at each finished
        canvas: `_grow_rows_allowed`)."""
        self.rows_ceiling = max(1, min(self.rows_ceiling, rows - 1))
        self.rows_allowed = max(1, min(self.rows_ceiling, rows // 2))
        self._out_of_memory_at = time.perf_counter()

    def _admit(self) -> None:
        free = [i for i, r in enumerate(self.results) if r is None]
        room = self.rows_allowed - (len(self.results) - len(free))
        free = free[: max(0, room)]
        joining: list[int] = []
        while free and self.waiting:
            slot, res = free.pop(0), self.waiting.popleft()
            self.results[slot] = res
            res.admitted = time.perf_counter()
            joining.append(slot)
            self._configure_slot(slot, res.request)
        if joining:
            self._prefill(joining)
            for slot in joining:
                self._start_canvas(slot)

    def _configure_slot(self, slot: int, req: Request) -> None:
        s = req.sampler
        self.seed[slot] = req.seed
        self.req_id[slot] = req.request_id if req.draw_id is None else req.draw_id
        self.n_steps[slot], self.t_min[slot] = s.max_denoising_steps, s.t_min
        self.t_span[slot] = s.t_max - s.t_min  # in double, as transformers takes it (`temperatures`)
        self.bound[slot], self.conf[slot], self.stab_k[slot] = (
            s.entropy_bound,
            s.confidence_threshold,
            s.stability_threshold,
        )
        self._reset_template(slot, req)
        self.canvas_idx[slot] = 0
        self.guides[slot] = None if req.guide is None else GuideState(req.guide, self.guide_room(req))
        self.cache.reset(torch.tensor([slot], device=self.device))

    def _reset_template(self, slot: int, req: Request) -> None:
        self.template[slot] = -1
        if req.template is not None:
            self.template[slot, : len(req.template)] = torch.tensor(req.template, device=self.device)

    def _keys(self, slots: torch.Tensor) -> RowKeys:
        return RowKeys(self.seed[slots], self.req_id[slots], self.canvas_idx[slots], self.step_idx[slots])

    def _start_canvas(self, slot: int) -> None:
        slots = torch.tensor([slot], device=self.device)
        self.step_idx[slot] = 0
        if (g := self.guides[slot]) is not None:
            res = self.results[slot]
            assert res is not None
            g.start_canvas(len(res.tokens))
            self._reset_template(slot, res.request)  # the previous canvas's accepted positions
        # the first pass sees pure noise even where a template pins tokens: the model was trained with
        # every position corrupted alike, and reads intact pinned cells amid noise as a nearly clean
        # canvas, trusting the noise (-2.5 points on Sudoku, the whole pinned/unpinned gap: BENCHMARKS.md, "Embedded model accuracy").
        # The template enters with the first step's output (sampler `accept`) and pins every argmax.
        x = self.draws.initial_canvas(self._keys(slots), self.canvas_length, self.vocab)
        self.x[slot] = x[0].to(self.device)
        self.has_sc[slot] = False
        self.done[slot] = False
        self.amax[slot] = -1
        self.stable[slot] = 0

    # ---- passes ---------------------------------------------------------------------------------
    def _causal_pass(self, slots: list[int], blocks: list[list[int]], fresh: bool) -> KV:
        """Prefill chunk or commit: one right-padded causal pass that writes K/V (`fresh`: every row's
        cache is empty, so no past is read). Returns the pass's new K/V ([rows, heads, width, dim])."""
        self._round = None  # the cache changes: positions, masks and past K/V of the round are stale
        idx = torch.tensor(slots, device=self.device)
        width = max(len(b) for b in blocks)
        tokens = torch.full((len(slots), width), self.pad_id, dtype=torch.long, device=self.device)
        for r, b in enumerate(blocks):
            tokens[r, : len(b)] = torch.tensor(b, device=self.device)
        lens = torch.tensor([len(b) for b in blocks], device=self.device)
        valid = torch.arange(width, device=self.device)[None, :] < lens[:, None]
        positions = canvas_positions(self.cache.lengths[idx], width)
        if fresh:
            past, meta = None, None
        else:
            past, meta = self.cache.read(idx)
        masks = attention_masks(positions, valid, meta, causal=True, window=self.cache.window)
        new_kv = self.backend.causal(tokens, positions, masks, past)
        self.cache.write(idx, new_kv, positions, valid)
        return new_kv

    def _prefill(self, slots: list[int]) -> None:
        """The joining rows' prompts into the cache, in chunks that end at block boundaries (cache on or off
        alike: what makes a cached block equal to a cold prefill's, `pipeline.runtime.prefix_cache`), all
        rows' chunks in one pass per turn. With the prefix cache, each turn first copies in the blocks it
        holds (from earlier requests, or from a row of this batch one turn earlier), and of several rows
        about to compute the same block only one does: the others copy it in on the next turn."""
        prompts = {s: self.results[s].request.prompt_ids for s in slots}  # type: ignore[union-attr]
        done = dict.fromkeys(slots, 0)
        step, cache = self.prefill_chunk, self.prefix_cache
        chains: dict[int, list[bytes]] = {}  # each prompt's block names, hashed once
        if cache is not None:
            for s in slots:
                cache.count_prompt(prompts[s])
                chains[s] = cache.keys(prompts[s])
        while True:
            if cache is not None:
                for s in slots:
                    restored = self._restore_blocks(s, prompts[s], chains[s], done[s])
                    done[s] += restored
                    self.results[s].cached_tokens += restored  # type: ignore[union-attr]
            if not (rows := [s for s in slots if done[s] < len(prompts[s])]):
                return
            if cache is not None:
                rows = self._distinct_blocks(rows, chains, done)
            chunks = [prompts[s][done[s] : (done[s] // step + 1) * step] for s in rows]
            new_kv = self._causal_pass(rows, chunks, fresh=not any(done[s] for s in rows))
            self.passes["prefill"] += 1
            for r, (s, chunk) in enumerate(zip(rows, chunks, strict=True)):
                if cache is not None and len(chunk) == step:
                    kv = [(k[r, :, :step].clone(), v[r, :, :step].clone()) for k, v in new_kv]
                    cache.insert(prompts[s], done[s] // step, kv, chains[s])
                done[s] += len(chunk)

    def _distinct_blocks(
        self, rows: list[int], chains: dict[int, list[bytes]], done: dict[int, int]
    ) -> list[int]:
        """The rows to prefill this turn: all but those whose next full block an earlier row computes now
        (`chains`: each row's block names, `PrefixCache.keys`)."""
        step, seen, keep = self.prefill_chunk, set(), []
        for s in rows:
            block = done[s] // step
            key = chains[s][block] if done[s] % step == 0 and block < len(chains[s]) else None
            if key is None or key not in seen:
                keep.append(s)
                seen.add(key)
        return keep

    def _restore_blocks(self, slot: int, prompt: list[int], chain: list[bytes], start: int) -> int:
        """Copy the cached blocks of `prompt` (block names `chain`) from position `start` (a block boundary;
        the row holds the tokens before it) into the slot's cache row; returns the tokens restored."""
        assert self.prefix_cache is not None
        if start % self.prefill_chunk:
            return 0  # the row's last, partial chunk was prefilled: nothing left to restore
        blocks = self.prefix_cache.lookup(prompt, first=start // self.prefill_chunk, keys=chain)
        if not blocks:
            return 0
        n = len(blocks) * self.prefill_chunk
        kv = [
            (torch.cat([b.kv[i][0] for b in blocks], dim=1)[None], torch.cat([b.kv[i][1] for b in blocks], dim=1)[None])
            for i in range(len(blocks[0].kv))
        ]  # fmt: skip
        positions = torch.arange(start, start + n, device=self.device)[None]
        valid = torch.ones_like(positions, dtype=torch.bool)
        self._round = None  # the cache changes, as in `_causal_pass`
        self.cache.write(torch.tensor([slot], device=self.device), kv, positions, valid)
        self.passes["prefix_hit"] += 1
        return n

    def _denoise(self, slots: torch.Tensor) -> list[int]:
        """Denoise passes for all rows in flight until the next host check; returns the finished slots.

        Positions, masks and past K/V only change when the cache or the set of rows does, so they are
        prepared once per round and every pass in between is device work only (a CUDA graph replay)."""
        if self._round is None or self._round.slot_list != slots.tolist():
            self._round = self._prepare_round(slots)
        rnd = self._round
        drafts = [(s, r) for s in rnd.slot_list if (r := self.results[s]) and r.request.on_draft]
        guided = [s for s in rnd.slot_list if self.guides[s] is not None]
        for _ in range(1 if drafts or guided else self.sync_every):
            if guided:  # the masks come from the host every pass: eager, then the host walks the canvas
                was_done = self.done[rnd.slots].tolist()
                prev = self.amax[rnd.slots].clone()
                kept = self._device_step(rnd)
                self._advance_guides(rnd, was_done, kept, prev)
            else:
                self.loop.run(rnd, lambda: self._device_step(rnd))
            self.passes["denoise"] += 1
            for slot, res in drafts:
                if self.results[slot] is not res:  # ended during this pass (a failed guide)
                    continue
                res.request.on_draft(res.request, self.amax[slot].tolist(), int(self.step_idx[slot]))  # type: ignore[misc]
        # a row whose guide failed was released: it is not finished, it is gone
        return [s for s in slots[self.done[slots]].tolist() if self.results[s] is not None]

    def _fail_guided_row(self, slot: int, e: Exception) -> None:
        """End one constrained row whose guide cannot go on (a guide the vocabulary cannot finish: its walk
        reaches a state where no token is allowed): that request alone ends with the error, its batch
        keeps going (reason "error", Result.error says why). Out of memory or a CUDA error in the guide's
        walk (it touches the device) is the step's failure instead, raised for the server to answer."""
        if device_failure(e):
            raise e
        res = self.results[slot]
        if res is not None:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            res.error = f"the guide cannot be followed over this model's vocabulary: {first}"
        self._release(slot, "error")

    def _advance_guides(
        self, rnd: DenoiseRound, was_done: list[bool], kept: torch.Tensor, prev: torch.Tensor
    ) -> None:
        """After a pass: accept what keeps each constrained canvas completable and pin it (guided.advance)."""
        for r, slot in enumerate(rnd.slot_list):
            g, res = self.guides[slot], self.results[slot]
            if g is None or was_done[r] or res is None:
                continue
            base = res.request.template or []
            pinned = [i < len(base) and base[i] >= 0 for i in range(self.canvas_length)]
            amax = self.amax[slot].tolist()
            try:
                pins = advance(g, amax, prev[r].tolist(), kept[r].tolist(), pinned, self.pad_id)
            except RuntimeError as e:
                self._fail_guided_row(slot, e)
                continue
            if pins:
                pos = torch.tensor(list(pins), device=self.device)
                tok = torch.tensor(list(pins.values()), device=self.device)
                for buf in (self.template, self.x, self.amax):
                    buf[slot, pos] = tok
                probs = self.guide_probs.get(slot)  # this pass's masked distribution, which decoded them
                if (k := res.request.logprobs) is not None and probs is not None:
                    self._write_logprobs(slot, pos, tok, probs[pos], k)
            if g.settled(self.canvas_length):
                self.done[slot] = True

    def _prepare_round(self, slots: torch.Tensor) -> DenoiseRound:
        past, meta = self.cache.read(slots, room=self.cache.room)
        positions = canvas_positions(self.cache.lengths[slots], self.canvas_length)
        masks = attention_masks(
            positions, torch.ones_like(positions, dtype=torch.bool), meta, False, self.cache.window
        )
        rnd = DenoiseRound(slots, slots.tolist(), positions, masks, past)
        wanted = [
            (i, req.logprobs)
            for i, s in enumerate(rnd.slot_list)
            if (res := self.results[s]) is not None
            and (req := res.request).logprobs is not None
            and self.guides[s] is None  # a constrained row's are read as its guide takes each token
        ]
        if wanted:
            rnd.logprob_rows = torch.tensor([i for i, _ in wanted], device=self.device)
            rnd.logprob_k = max(k for _, k in wanted)
        return rnd

    def _device_step(self, rnd: DenoiseRound) -> torch.Tensor:
        """One denoise pass + sampling step with no host synchronisation; finished rows stay frozen.
        Returns the rows' kept positions [B, L] (read by the host only for constrained rows)."""
        slots = rnd.slots
        live = ~self.done[slots]
        sampler = SamplerInputs(
            temperature=temperatures(
                self.step_idx[slots], self.n_steps[slots], self.t_min[slots], self.t_span[slots]
            ),
            bound=self.bound[slots],
            keys=self._keys(slots),
            template=self.template[slots],
            prev_argmax=self.amax[slots],
            stable_count=self.stable[slots],
            stability_threshold=self.stab_k[slots],
            confidence_threshold=self.conf[slots],
            allowed=self._guide_masks(rnd),
        )
        stepped = self.backend.denoise_step(
            self.x[slots], self._sc_input(rnd), rnd.positions, rnd.masks, rnd.past, sampler,
            need_soft=not self._last_pass(slots, live),
        )  # fmt: skip
        out, row = stepped.step, live[:, None]
        if stepped.soft is not None:  # a frozen row's is never read: its canvas is over
            self.sc[slots] = stepped.soft.to(self.dtype)
        if sampler.allowed is not None:
            self._keep_guide_probs(rnd, stepped, sampler, live)
        if rnd.logprob_rows is not None:
            self._keep_logprobs(rnd, stepped, sampler, live)
        for slot in rnd.slot_list:
            self.has_sc[slot] = True
        self.stable[slots] = torch.where(live, stepped.stable_count, self.stable[slots])
        self.x[slots] = torch.where(row, out.canvas, self.x[slots])
        self.amax[slots] = torch.where(row, out.argmax, self.amax[slots])
        self.step_idx[slots] += live.long()
        self.done[slots] |= live & (stepped.stop | (self.step_idx[slots] >= self.n_steps[slots]))
        return out.kept

    def _last_pass(self, slots: torch.Tensor, live: torch.Tensor) -> bool:
        """Every live row reaches its step limit with this pass, so no later pass reads its self-conditioning
        input. Known only by reading the step counters, which is free on the CPU; elsewhere the step stays
        free of host reads (a CUDA graph replays it) and always computes the input."""
        if self.device.type != "cpu":
            return False
        return not bool((live & (self.step_idx[slots] + 1 < self.n_steps[slots])).any())

    def _keep_guide_probs(
        self, rnd: DenoiseRound, stepped: DenoiseResult, sampler: SamplerInputs, live: torch.Tensor
    ) -> None:
        for i, slot in enumerate(rnd.slot_list):
            if self.guides[slot] is None:
                continue
            new = sampled_distribution(stepped, sampler, slice(i, i + 1))[0].to(torch.bfloat16)
            kept = self.guide_probs.get(slot)
            # a copy: already bf16 (CUDA), `new` is a view that would keep the whole batch's probabilities
            self.guide_probs[slot] = new.clone() if kept is None else torch.where(live[i], new, kept)

    def _keep_logprobs(
        self, rnd: DenoiseRound, stepped: DenoiseResult, sampler: SamplerInputs, live: torch.Tensor
    ) -> None:
        """The log-probabilities of this pass for the rows that want them, kept per slot while the row is
        live: a canvas's last live pass is the one whose argmax canvas is committed, so what is left when
        it finishes is each committed token's log-probability under the distribution softmax(logits / T)
        the sampler drew from at that pass (T: its temperature), and the top alternatives of the same
        distribution. Device work only (a captured step replays it)."""
        # validate() admits logprobs only from a backend that returns probs (or the logits they are read from)
        rows, k = rnd.logprob_rows, rnd.logprob_k
        slots, keep = rnd.slots[rows], live[rows][:, None]
        p = sampled_distribution(stepped, sampler, rows)
        token = p.gather(-1, stepped.step.argmax[rows][..., None]).squeeze(-1).float().log()
        self.lp_token[slots] = torch.where(keep, token, self.lp_token[slots])
        if k:
            top, ids = p.topk(k, dim=-1)
            keep3 = keep[..., None]
            self.lp_top[slots, :, :k] = torch.where(keep3, top.float().log(), self.lp_top[slots, :, :k])
            self.lp_ids[slots, :, :k] = torch.where(keep3, ids, self.lp_ids[slots, :, :k])

    def _write_logprobs(
        self, slot: int, positions: torch.Tensor, tokens: torch.Tensor, dist: torch.Tensor, k: int
    ) -> None:
        """The log-probabilities of a constrained canvas's `tokens` at `positions` under `dist` [n, V], the
        masked distribution each was decoded from, and its top k."""
        self.lp_token[slot, positions] = dist.gather(-1, tokens[:, None]).squeeze(-1).float().log()
        if k:
            top, ids = dist.topk(k, dim=-1)
            self.lp_top[slot, positions, :k], self.lp_ids[slot, positions, :k] = top.float().log(), ids

    def _write_decoded(self, slot: int, decoded: list[DecodedLogprob], k: int) -> None:
        """The positions `finish_canvas` decoded (`decoded_logprob`), written at once."""
        if not decoded:
            return
        dev = self.device
        positions = torch.tensor([d.position for d in decoded], device=dev)
        self.lp_token[slot, positions] = torch.tensor([d.logprob for d in decoded], device=dev)
        if k:
            self.lp_top[slot, positions, :k] = torch.tensor([d.top for d in decoded], device=dev)
            self.lp_ids[slot, positions, :k] = torch.tensor([d.ids for d in decoded], device=dev)

    def _logprobs(self, slot: int, n: int, k: int) -> list[TokenLogprob]:
        """The first n committed tokens' log-probabilities and top-k alternatives, for the host."""
        token = self.lp_token[slot, :n].tolist()
        top, ids = self.lp_top[slot, :n, :k].tolist(), self.lp_ids[slot, :n, :k].tolist()
        return [(t, list(zip(i, v, strict=True))) for t, i, v in zip(token, ids, top, strict=True)]

    def _guide_masks(self, rnd: DenoiseRound) -> tuple[torch.Tensor, torch.Tensor] | None:
        for slot in rnd.slot_list:  # a row whose guide has no mask left fails alone, before the batch's pass
            g = self.guides[slot]
            if g is not None and not g.settled(self.canvas_length):
                try:
                    g.automaton.allowed(g.state, g.remaining(g.frontier))
                except RuntimeError as e:
                    self._fail_guided_row(slot, e)
        guides = [self.guides[s] for s in rnd.slot_list]
        if all(g is None for g in guides):
            return None
        return mask_rows(guides, self.canvas_length, self.vocab, self.device)

    def _sc_input(self, rnd: DenoiseRound) -> torch.Tensor | None:
        """The rows' self-conditioning soft embeddings: None (no signal: the network skips the MLP, as
        transformers does) when every row starts a canvas; rows without a previous step are zeroed, which
        is exactly "no signal" too (zero probs give a zero embedding). Only a round's first step can be None
        or mixed: every later step (the one a CUDA graph captures) has a signal for every row. Under CUDA
        graphs that first step is the capture's warm-up, so it gets zeros instead of None: the MLP then
        runs there first (its output exactly zero), and no kernel of it loads inside a capture, which
        CUDA refuses."""
        ready = [self.has_sc[s] for s in rnd.slot_list]
        if not any(ready):
            return torch.zeros_like(self.sc[rnd.slots]) if self.loop.graphs else None
        if all(ready):
            return self.sc[rnd.slots]
        # where, not a multiply: a slot's last occupant may have left non-finite values (NaN * 0 is NaN)
        mask = torch.tensor(ready, dtype=torch.bool, device=self.device)
        return torch.where(mask[:, None, None], self.sc[rnd.slots], 0.0)

    def _finalise(self, slots: list[int]) -> None:
        """The canvases that finished: each one's tokens handed to its request (`_emit`), then committed to
        the cache for the rows that go on (`_commit`) and released for those that are done."""
        self._grow_rows_allowed(len(slots))
        commits: list[int] = []
        for slot in slots:
            res = self.results[slot]
            assert res is not None
            block = self._committed_block(slot, res)
            if block is None:  # its guide could not finish the canvas: the row was released with the error
                continue
            reason = self._emit(slot, res, block)
            if (
                not reason
                and context_length(int(self.cache.lengths[slot]), 0, self.canvas_length) > self.max_len
            ):
                reason = "length"  # no room for another canvas in the context
            if reason:
                self._release(slot, reason)
            else:
                commits.append(slot)
        if commits:
            self._commit(commits)

    def _grow_rows_allowed(self, finished: int) -> None:
        """The other half of `after_out_of_memory`: one more row admitted per finished canvas, up to the
        ceiling, and the ceiling one row higher per `CEILING_RECOVERY_S` without another failure (idle
        periods count), up to max_batch."""
        if self.rows_ceiling < self.max_batch:
            periods = int((time.perf_counter() - self._out_of_memory_at) // CEILING_RECOVERY_S)
            if periods > 0:
                self.rows_ceiling = min(self.max_batch, self.rows_ceiling + periods)
                self._out_of_memory_at += periods * CEILING_RECOVERY_S
        self.rows_allowed = min(self.rows_ceiling, self.rows_allowed + finished)

    def _committed_block(self, slot: int, res: Result) -> list[int] | None:
        """A finished canvas's tokens as the commit writes them: its argmax canvas, or for a constrained row
        the guide's completion of it (`finish_canvas`; the decoded tokens' log-probabilities written). None
        where the guide cannot complete it: the row is released with the error (`_fail_guided_row`)."""
        block = self.amax[slot].tolist()
        if (g := self.guides[slot]) is None:
            return block
        k = res.request.logprobs
        decoded: list[DecodedLogprob] = []
        on_decode = None if k is None else lambda *a: decoded.append(decoded_logprob(*a, k=k))
        try:
            block = finish_canvas(
                g, block, self.guide_probs.pop(slot), self.pad_id, on_decode=on_decode,
                pins=res.request.template or (),
            )  # fmt: skip
        except RuntimeError as e:
            self._fail_guided_row(slot, e)
            return None
        self.amax[slot] = torch.tensor(block, device=self.device)  # what the commit writes
        if k is not None:
            self._write_decoded(slot, decoded, k)
        return block

    def _emit(self, slot: int, res: Result, block: list[int]) -> str:
        """Hand a finished canvas to its request: the tokens `emitted_tokens` keeps, their log-probabilities,
        the step count, the `on_canvas` callback. Returns why the request stops ("" if it goes on)."""
        res.steps_per_canvas.append(int(self.step_idx[slot]))
        if not res.tokens and res.time_to_first_canvas == 0.0:
            res.time_to_first_canvas = time.perf_counter() - res.started
        # an end token stops the request only once min_tokens precede it (vLLM's min_tokens); a guided
        # output ends where its guide accepted one, min_tokens or not: its language admits nothing after it
        g = self.guides[slot]
        floor = 0 if g is not None and g.ended else res.request.min_tokens - len(res.tokens)
        emitted, reason = emitted_tokens(block, self.end_ids, floor, res.request.max_tokens - len(res.tokens))
        res.tokens.extend(emitted)
        if (k := res.request.logprobs) is not None:
            res.logprobs.extend(self._logprobs(slot, len(emitted), k))
        if res.request.on_canvas is not None:
            res.request.on_canvas(res.request, emitted)
        return reason

    def _commit(self, slots: list[int]) -> None:
        """The finished canvases of the rows that go on into the cache (one causal pass), then a new canvas
        for each."""
        self._causal_pass(slots, [self.amax[s].tolist() for s in slots], fresh=False)
        self.passes["commit"] += 1
        for slot in slots:
            self.canvas_idx[slot] += 1
            self._start_canvas(slot)

    def _release(self, slot: int, reason: str) -> None:
        self._round = None
        res = self.results[slot]
        self.results[slot] = None
        self.guides[slot] = None
        self.guide_probs.pop(slot, None)
        if res is not None:
            self._finish(res, reason)

    @staticmethod
    def _finish(res: Result, reason: str) -> None:
        res.finish_reason = reason
        res.finished = time.perf_counter()
        if res.request.on_finish is not None:
            res.request.on_finish(res)
