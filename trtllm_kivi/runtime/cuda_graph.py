"""CUDA-graph-captured decode steps over a TorchRunner's model and cache: one captured step per batch size, replayed
with the step's device tensors updated in place.

What stops TorchRunner.step from being captured, and what this module does instead:
- the step's tensors are built on the host each step (torch.tensor(..., device=cuda): blocking copies) -> static
  device tensors per batch size; the cache's host bookkeeping (begin_step: capacity checks, block assignment) still
  runs before each replay, and its tensors are copied in device to device;
- LlamaModel.forward sizes the RoPE tables with int(positions.max()) (a host sync) -> the tables are sized once
  for the cache's capacity and indexed by the static positions inside the graph (`forward` below is the model's
  forward for one decode token per sequence; tests/test_cuda_graph.py checks it against LlamaModel.forward);
- the cuda backend sizes its grid and split from host bounds (max of past + chunk) -> the captured step's host
  lengths say the cache's capacity, so one graph serves every length up to it (the kernels read the real lengths
  from device memory and guard the rest);
- FullCache's torch attention slices each sequence by its host length -> Fp16GraphAttention writes the new k/v at
  device positions and attends with device lengths (flash attention's varlen kernel with seqused_k, or SDPA with a
  mask built on the device).
Whatever a captured step allocates (workspace, activations) comes from the graphs' private pool at fixed
addresses. `capture=False` runs the same step body eagerly with the cache's own step (any device, any backend):
what the CPU tests compare against the runner.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache import FullCache, KiviCache, Step
from .torch_runner import TorchRunner

FP16_METHODS = ("flash_varlen", "sdpa_masked")


class Fp16GraphAttention:
    """Decode attention over a FullCache's K/V with lengths on the device only (graph-safe): the new token's k/v
    written at (slot, past_len), then attention over past_len + 1 keys per sequence.

    flash_varlen: torch's flash attention varlen kernel over a strided view of the cache ([slot, Hkv, S, D] seen as
    rows of D; each sequence starts at slot * Hkv * S, length seqused_k), exact lengths, no mask.
    sdpa_masked: SDPA of the group heads as query rows over the whole capacity S with a key mask (needs the step's
    slots to be 0..B-1, checked by GraphDecoder on the host)."""

    def __init__(self, cache: FullCache, method: str = "flash_varlen") -> None:
        if method not in FP16_METHODS:
            raise ValueError(f"FP16 graph attention method {method!r} is not supported; allowed: "
                             f"{', '.join(FP16_METHODS)}")
        self.cache, self.method = cache, method
        self.h, self.hkv, self.d = cache.geom.num_heads, cache.geom.num_kv_heads, cache.geom.head_dim
        self.capacity = cache.max_seq_len
        self.key_index = torch.arange(self.capacity, device=cache.device)
        self._cu_q: dict[int, torch.Tensor] = {}

    def rotations(self, layer: int) -> tuple[str, str]:
        return "none", "none"

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        """q [B, H, D], k/v [B, Hkv, D] (one token per sequence) -> out [B, H, D]."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]  # [slots, Hkv, S, D]
        slot, pos = step.slot_ids.long(), step.past_len.long()
        kc[slot, :, pos] = k
        vc[slot, :, pos] = v
        lens = step.past_len + 1
        if self.method == "flash_varlen":
            return self._flash_varlen(q, kc, vc, step.slot_ids, lens)
        return self._sdpa_masked(q, kc, vc, lens)

    def _flash_varlen(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slot_ids: torch.Tensor,
                      lens: torch.Tensor) -> torch.Tensor:
        b, s, hkv, d = q.shape[0], self.capacity, self.hkv, self.d
        rows = (kc.shape[0] - 1) * hkv * s + s  # the view ends exactly at the cache's last element

        def view(t: torch.Tensor) -> torch.Tensor:
            return t.as_strided((rows, hkv, d), (d, s * d, 1))
        if b not in self._cu_q:
            self._cu_q[b] = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        starts = slot_ids * (hkv * s)
        cu_k = torch.cat([starts, starts[-1:] + s])  # only the starts matter: seqused_k gives the lengths
        out = torch.ops.aten._flash_attention_forward(q, view(kc), view(vc), self._cu_q[b], cu_k, 1, s, 0.0, False,
                                                      False, scale=1.0 / math.sqrt(d), seqused_k=lens)
        return out[0]

    def _sdpa_masked(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lens: torch.Tensor
                     ) -> torch.Tensor:
        b = q.shape[0]
        mask = self.key_index[None, :] < lens[:, None]  # [B, S]: keys 0..past
        out = F.scaled_dot_product_attention(q.view(b, self.hkv, self.h // self.hkv, self.d).to(kc.dtype), kc[:b],
                                             vc[:b], attn_mask=mask[:, None, None, :])
        return out.reshape(b, self.h, self.d).to(q.dtype)


@dataclass
class _Static:
    """One batch size's step tensors (fixed addresses the graph reads) and its captured graph."""

    ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    step: Step  # device tensors: slot_ids, past_len, chunk_len, block_table; host lengths = the capacity
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class GraphDecoder:
    """Decode steps (one new token per sequence) of `runner` as CUDA-graph replays.

    step(slots, tokens) runs one decode step and returns the logits [B, vocab] (the graph's output tensor: the next
    replay overwrites it). tokens=None feeds each sequence the previous step's greedy token, already on the device
    (the graph writes it), so consecutive steps need no host round trip. KIVI caches need the cuda backend; an FP16
    cache attends with Fp16GraphAttention(fp16_method)."""

    def __init__(self, runner: TorchRunner, fp16_method: str = "flash_varlen", capture: bool = True) -> None:
        self.model, self.cache = runner.model, runner.cache
        if isinstance(self.cache, KiviCache):
            if capture and self.cache.backend_name != "cuda":
                raise ValueError(f"CUDA-graph decode needs the cuda attention backend; the cache uses "
                                 f"{self.cache.backend_name!r}")
            self.attn: KiviCache | Fp16GraphAttention = self.cache
        elif isinstance(self.cache, FullCache):
            self.attn = Fp16GraphAttention(self.cache, fp16_method)
        else:
            raise ValueError(f"GraphDecoder takes a KiviCache or a FullCache, not {type(self.cache).__name__}")
        if capture and self.cache.device.type != "cuda":
            raise ValueError(f"CUDA-graph capture needs a CUDA device; the cache is on {self.cache.device}")
        self.capture = capture
        self.capacity = self.cache.max_seq_len
        cos, sin = self.model.rope_tables(self.capacity)  # sized once: no host sync inside the step
        self.cos, self.sin = cos[:self.capacity], sin[:self.capacity]
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._static: dict[int, _Static] = {}
        self._last_tokens: dict[int, bool] = {}

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, step: Step) -> torch.Tensor:
        """LlamaModel.forward for one token per sequence with RoPE rows gathered on the device: fp32 logits
        [B, vocab]."""
        m = self.model
        cos, sin = self.cos[positions], self.sin[positions]  # [B, D]
        x = F.embedding(ids, m.embed)
        for i, layer in enumerate(m.layers):
            x = layer(x, cos, sin, i, self.attn, step)
        x = m.norm(x)
        return F.linear(x, m.embed if m.lm_head is None else m.lm_head).float()

    def _body(self, c: _Static, step: Step) -> torch.Tensor:
        logits = self.forward(c.ids, c.positions, step)
        c.ids.copy_(logits.argmax(-1))  # the next step's greedy tokens, written on the device
        return logits

    def _make_static(self, b: int) -> _Static:
        dev = self.cache.device
        i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=dev)  # noqa: E731
        table_width = self.cache.block_tables.shape[1] if isinstance(self.cache, KiviCache) else 0
        step = Step(list(range(b)), [self.capacity - 1] * b, [1] * b, i32(b), i32(b), i32(b) + 1,
                    i32(b, table_width))
        return _Static(torch.zeros(b, dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.long, device=dev),
                       step)

    def step(self, slots: Sequence[int], tokens: Sequence[int] | None = None) -> torch.Tensor:
        """One decode step: slot slots[b] gets tokens[b] (None: the previous step's greedy tokens)."""
        b = len(slots)
        if tokens is None and not self._last_tokens.get(b):
            raise ValueError("tokens=None feeds the previous step's greedy tokens; the first step of a batch size "
                             "needs explicit tokens")
        if tokens is not None and len(tokens) != b:
            raise ValueError(f"{len(tokens)} tokens for {b} slots: a decode step takes one token per slot")
        if isinstance(self.attn, Fp16GraphAttention) and self.attn.method == "sdpa_masked" \
                and list(slots) != list(range(b)):
            raise ValueError(f"the sdpa_masked FP16 attention reads cache rows 0..{b - 1}; slots {list(slots)} "
                             f"must be exactly those")
        step = self.cache.begin_step(slots, [1] * b)  # capacity and blocks checked; nothing changes on error
        c = self._static.get(b) or self._make_static(b)
        self._static[b] = c
        if tokens is not None:
            c.ids.copy_(torch.tensor(list(tokens), dtype=torch.long))
        c.positions.copy_(step.past_len)
        for name in ("slot_ids", "past_len", "block_table"):
            dst = getattr(c.step, name)
            if dst.numel():
                dst.copy_(getattr(step, name))
        with torch.no_grad():
            if not self.capture:
                c.logits = self._body(c, step)
            elif c.graph is None:
                c.logits = self._capture(c)
            else:
                c.graph.replay()
        self.cache.end_step(step)
        self._last_tokens[b] = True
        assert c.logits is not None
        return c.logits

    def _capture(self, c: _Static) -> torch.Tensor:
        """Run the step once eagerly on a side stream (the warm-up is this step's real computation: attention,
        append, the next greedy tokens), then capture the same body into a graph (capture records, it runs
        nothing); returns the graph's output tensor holding the eager logits."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager = self._body(c, c.step)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._body(c, c.step)
        c.graph = graph
        logits.copy_(eager)
        return logits

    def graphs(self) -> list[int]:
        """Batch sizes with a captured step."""
        return sorted(b for b, c in self._static.items() if c.graph is not None)
