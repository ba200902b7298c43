"""MemoKiviCache: a KiviCache whose attention keeps each sequence's dequantized history between steps.

The reference op (reference.attention.kivi_attention_) dequantizes a sequence's whole quantized store on every
step and layer; on the CPU that dominates decode-mode scoring. The store is append-only (a quantized group never
changes until the sequence is freed) and dequantization is elementwise, so dequantizing only the groups added since
the last step and concatenating gives bit-identical history, hence bit-identical attention (tests/test_eval_scoring.py
checks torch.equal against KiviCache on the same inputs). Storage, flushing and every buffer are KiviCache's own
(reference `append`); only the read side is memoized.
"""

from __future__ import annotations

import math

import torch

from ..cache import KiviCache, Step
from ..reference.attention import _blocks_of, _rows, append, attend, check_step
from ..reference.kv import dequantize_keys, dequantize_values


class MemoKiviCache(KiviCache):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._memo: dict[tuple[int, int], tuple[int, torch.Tensor, torch.Tensor]] = {}  # (layer, slot) -> n, K, V

    @classmethod
    def like(cls, cache: KiviCache) -> "MemoKiviCache":
        """A fresh MemoKiviCache with the same configuration, geometry and capacity as `cache`."""
        return cls(cache.cfg, cache.geom, cache.max_slots, cache.max_seq_len, cache.dtype, cache.device,
                   cache.num_blocks)

    def free_sequence(self, slot: int) -> None:
        super().free_sequence(slot)
        for key in [k for k in self._memo if k[1] == slot]:
            del self._memo[key]

    def _quantized_history(self, layer: int, slot: int, table_row: torch.Tensor, n_q: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K/V [Hkv, n_q, D] of the first n_q tokens, extending the memo by the new groups only."""
        buf, cfg, bs = self.layers[layer], self.cfg, self.cfg.block_size
        _, hkv, _, d = buf.k_window.shape
        n, k_old, v_old = self._memo.get((layer, slot), (0, None, None))
        if n > n_q:  # cannot happen for a live sequence (the store only grows); recompute to be safe
            n, k_old, v_old = 0, None, None
        if n == n_q and k_old is not None:
            return k_old, v_old
        b0, b1 = n // bs, math.ceil(n_q / bs)  # blocks holding the new tokens [n, n_q)
        sub = table_row[b0:b1]
        m = n_q - b0 * bs  # tokens of those blocks in the store
        kc, ks, kz = (_blocks_of(t, sub, b1 - b0) for t in buf[0:3])
        vc, vs, vz = (_blocks_of(t, sub, b1 - b0) for t in buf[3:6])
        k_new = dequantize_keys(kc, ks, kz, cfg, m, d, buf.k_window.dtype)[:, n - b0 * bs:]
        v_new = dequantize_values(vc[:, :m], vs[:, :m], vz[:, :m], cfg, d, buf.v_window.dtype)[:, n - b0 * bs:]
        k_all = k_new if k_old is None else torch.cat([k_old, k_new], dim=1)
        v_all = v_new if v_old is None else torch.cat([v_old, v_new], dim=1)
        self._memo[(layer, slot)] = (n_q, k_all, v_all)
        return k_all, v_all

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        """Same contract and result as KiviCache.attention (attend, then append)."""
        buf, cfg = self.layers[layer], self.cfg
        check_step(q, k, v, step.slot_ids, step.past_len, step.chunk_len, step.block_table, buf, cfg)
        out = torch.empty_like(q)
        off = 0
        for b, (slot, s, c) in enumerate(zip(step.slots, step.past, step.chunk)):
            if c == 0:
                continue
            rows = slice(off, off + c)
            kc, vc = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [Hkv, c, D]
            n_q, s0 = cfg.num_quantized(s), min(cfg.sink_tokens, s)
            sink, ring = slice(0, s0), _rows(cfg, s0 + n_q, s)  # token order: sinks, store, ring, chunk
            if n_q:
                kq, vq = self._quantized_history(layer, slot, step.block_table[b], n_q)
                kh = torch.cat([buf.k_window[slot][:, sink], kq, buf.k_window[slot][:, ring], kc], dim=1)
                vh = torch.cat([buf.v_window[slot][:, sink], vq, buf.v_window[slot][:, ring], vc], dim=1)
            else:
                kh = torch.cat([buf.k_window[slot][:, sink], buf.k_window[slot][:, ring], kc], dim=1)
                vh = torch.cat([buf.v_window[slot][:, sink], buf.v_window[slot][:, ring], vc], dim=1)
            out[rows] = attend(q[rows], kh, vh, s)
            append(buf, cfg, slot, step.block_table[b], s, kc, vc)
            off += c
        return out
