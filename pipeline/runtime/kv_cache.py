"""Pre-allocated KV cache: full-length buffers for global layers, ring buffers for sliding layers.

A sliding layer only ever needs the last (window - 1) committed tokens (the query itself is the window's
last slot), so its buffer has exactly that many slots and a token lives at slot `position % (window - 1)`.
Rows are independent "slots" so requests of different lengths share one cache and join or leave at canvas
boundaries. Only prefill and commit write tokens into it. A denoise pass may also use its buffers' room past
the tokens held (`read(..., room=...)`): attention writes the canvas's K/V there and reads the held tokens
and the canvas in place, instead of concatenating them into a copy of the whole context every step.
Nothing reads that room as tokens: it lies past every row's length and, in a ring, in slots no position maps
to or none holds yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.model.config import TextConfig
from pipeline.model.network import PastWithRoom


@dataclass
class KeyMeta:
    """Absolute position of each cached key ([B, K]) and whether it holds a token."""

    positions: torch.Tensor
    valid: torch.Tensor


def canvas_room(backend: object, canvas_length: int) -> int:
    """Slots the cache keeps past a sliding layer's ring for a canvas's K/V: a canvas's worth where the
    backend's denoise pass writes them there (`writes_kv_in_place`), else none. The runtime's cache and the
    memory plan (`quantize.planner.kv_cache_bytes`) both size it here."""
    return canvas_length if getattr(backend, "writes_kv_in_place", False) else 0


class KVCache:
    def __init__(
        self,
        cfg: TextConfig,
        slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        room: int = 0,
    ) -> None:
        """`room`: slots beyond a ring's for a canvas's K/V (`read`); a full-length buffer has room past its
        rows' lengths wherever the canvas fits in `max_len`."""
        self.window = cfg.sliding_window
        self.ring = max(cfg.sliding_window - 1, 1)
        self.room = room
        self.max_len = max_len
        self.layer_types = list(cfg.layer_types)  # type: ignore[arg-type]
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for i, kind in enumerate(self.layer_types):
            shape = cfg.layer_shape(i)
            length = self.ring + room if kind == "sliding_attention" else max_len
            self.k.append(
                torch.zeros(slots, shape.num_kv_heads, length, shape.head_dim, dtype=dtype, device=device)
            )
            self.v.append(torch.zeros_like(self.k[-1]))
        self.ring_pos = torch.full((slots, self.ring), -1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)

    def reset(self, slots: torch.Tensor) -> None:
        """Free rows for new requests; stale K/V stay in memory but are masked by length/ring_pos."""
        self.lengths[slots] = 0
        self.ring_pos[slots] = -1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def read(
        self, slots: torch.Tensor, room: int = 0
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, KeyMeta]]:
        """The cached K/V of some rows, trimmed to the longest of them, and where each key sits. `room`: where
        the rows are a range of the buffers and every buffer has that many free slots past the tokens read,
        each layer's K/V come with them (`network.PastWithRoom`, views of the buffers), for a denoise pass to
        write its canvas's K/V into; elsewhere the K/V alone (attention then concatenates)."""
        lengths = self.lengths[slots]
        kmax = int(lengths.max()) if lengths.numel() else 0
        # rows are handed out lowest-first, so the rows in flight are usually a range: then views, no copy
        first, n = int(slots[0]) if len(slots) else 0, len(slots)
        rows = slice(first, first + n) if slots.tolist() == list(range(first, first + n)) else slots
        # a token at position p sits in ring slot p % ring, so while every row is shorter than the ring only
        # its first kmax slots hold tokens: reading just those keeps attention (and the K/V concatenation) to
        # the keys that exist, and a batch of equal lengths needs no mask at all (`attention_masks`)
        filled = min(kmax, self.ring)
        with_room = room > 0 and isinstance(rows, slice) and room <= self.room and kmax + room <= self.max_len
        past: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, kind in enumerate(self.layer_types):
            n = filled if kind == "sliding_attention" else kmax
            if with_room:
                past.append(PastWithRoom(self.k[i][rows, :, : n + room], self.v[i][rows, :, : n + room], n))
            else:
                past.append((self.k[i][rows, :, :n], self.v[i][rows, :, :n]))
        gpos = torch.arange(kmax, device=lengths.device)[None, :].expand(len(slots), kmax)
        ring_pos = self.ring_pos[slots, :filled]
        meta = {
            "full_attention": KeyMeta(gpos, gpos < lengths[:, None]),
            "sliding_attention": KeyMeta(ring_pos, ring_pos >= 0),
        }
        return past, meta

    def write(
        self,
        slots: torch.Tensor,
        new_kv: list[tuple[torch.Tensor, torch.Tensor]],
        positions: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """Append the valid entries of a causal pass; positions [B, Q] continue each row's length."""
        end = self.lengths[slots] + valid.sum(dim=1)
        if int(end.max()) > self.max_len:
            raise ValueError(f"KV cache overflow: {int(end.max())} tokens > {self.max_len} slots")
        rows, cols = valid.nonzero(as_tuple=True)
        in_ring = positions[rows, cols] >= end[rows] - self.ring
        r_rows, r_cols = rows[in_ring], cols[in_ring]
        ring_slot = positions[r_rows, r_cols] % self.ring
        for i, kind in enumerate(self.layer_types):
            k, v = new_kv[i]
            if kind == "sliding_attention":
                self.k[i][slots[r_rows], :, ring_slot] = k[r_rows, :, r_cols].to(self.k[i].dtype)
                self.v[i][slots[r_rows], :, ring_slot] = v[r_rows, :, r_cols].to(self.v[i].dtype)
            else:
                self.k[i][slots[rows], :, positions[rows, cols]] = k[rows, :, cols].to(self.k[i].dtype)
                self.v[i][slots[rows], :, positions[rows, cols]] = v[rows, :, cols].to(self.v[i].dtype)
        self.ring_pos[slots[r_rows], ring_slot] = positions[r_rows, r_cols]
        self.lengths[slots] = end


def attention_masks(
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    past: dict[str, KeyMeta] | None,
    causal: bool,
    window: int,
) -> dict[str, torch.Tensor | None]:
    """Boolean masks [B, 1, Q, Kpast + Q] per layer type for keys = cat(past, new).

    Causal passes see keys at positions <= their own (sliding layers also > pos - window). Denoise passes
    see every valid cached key and the whole canvas; a sliding layer's cache holds the last window - 1
    tokens, which is exactly what transformers' decoder attends to.
    """
    b, q = q_pos.shape
    eye = torch.eye(q, dtype=torch.bool, device=q_pos.device)[None]
    masks = {}
    for kind in ("full_attention", "sliding_attention"):
        if past is not None:
            kpos = torch.cat([past[kind].positions, q_pos], dim=1)
            kvalid = torch.cat([past[kind].valid, q_valid], dim=1)
        else:
            kpos, kvalid = q_pos, q_valid
        allowed = kvalid[:, None, :].expand(b, q, kpos.shape[1])
        if causal:
            allowed = allowed & (kpos[:, None, :] <= q_pos[:, :, None])
            if kind == "sliding_attention":
                allowed = allowed & (kpos[:, None, :] > q_pos[:, :, None] - window)
        # every query may see itself, so padded queries never produce NaN rows
        allowed = torch.cat([allowed[:, :, : kpos.shape[1] - q], allowed[:, :, -q:] | eye], dim=2)
        # no mask at all when everything is visible: SDPA then takes its unmasked (faster) kernel
        masks[kind] = None if bool(allowed.all()) else allowed[:, None]
    return masks
