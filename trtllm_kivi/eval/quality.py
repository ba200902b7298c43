"""Decode-mode quality of several KV caches on the same text: perplexity, fidelity against the reference (FP16)
cache (KL, top-1 agreement) and how the error grows along the sequence (logits and every layer's attention output).

Each segment of `segment_len` corpus tokens is scored independently: tokens[:prefix] are prefilled as one chunk,
then positions prefix..segment_len-2 are scored through the cache in chunks that are exact per the streaming
contract (scoring.chunk_plan), identical for every cache so the comparison sees the same shapes. The reference
configuration runs first on each segment; the others are compared with it position by position on identical inputs
(teacher forcing), so differences come from the cache alone.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass
from collections.abc import Callable, Sequence

import torch

from ..format import KiviConfig
from ..models.llama import LlamaModel
from ..runtime.base import Runner
from .metrics import kl_from_log_probs, log_probs, nll_from_log_probs, perplexity, relative_error
from .scoring import chunk_plan, record_attention_outputs


@dataclass
class QualitySetup:
    segments: int = 10
    segment_len: int = 2048
    prefix: int = 256
    max_chunk: int = 32  # also the bin width of the error-growth curves
    offset: int = 0  # corpus token where the first segment starts
    batch: int = 16  # segments run together as one ragged batch (bigger matmuls)

    def __post_init__(self) -> None:
        if self.segments < 1:
            raise ValueError(f"segments={self.segments} must be >= 1")
        if not 1 <= self.prefix < self.segment_len - 1:
            raise ValueError(f"prefix={self.prefix} must be in [1, segment_len - 2 = {self.segment_len - 2}]")
        if self.max_chunk < 1 or self.offset < 0 or self.batch < 1:
            raise ValueError(f"max_chunk={self.max_chunk} and batch={self.batch} must be >= 1, offset={self.offset} >= 0")

    @property
    def scored_per_segment(self) -> int:
        return self.segment_len - 1 - self.prefix

    @property
    def tokens_needed(self) -> int:
        return self.offset + self.segments * self.segment_len


class _Recorder:
    """Collects each layer's attention output of every forward while active (scoring.record_attention_outputs)."""

    def __init__(self, rec: list[list[torch.Tensor]] | None) -> None:
        self.rec = rec

    def take(self) -> torch.Tensor | None:
        """Attention outputs of the forwards since the last take: [layers, T, dim] (None when not recording)."""
        if self.rec is None:
            return None
        out = torch.stack([torch.cat(r) for r in self.rec])
        for r in self.rec:
            r.clear()
        return out


def _bin(x: torch.Tensor, width: int) -> list:
    """Mean over consecutive bins of `width` positions of the last dim: [..., N] -> nested lists."""
    n = x.shape[-1]
    return torch.stack([x[..., a:a + width].mean(-1) for a in range(0, n, width)], dim=-1).tolist()


def evaluate_quality(model: LlamaModel, runners: dict[str, Runner], kivi: dict[str, KiviConfig | None],
                     token_ids: Sequence[int], setup: QualitySetup, reference: str = "fp16",
                     record_layers: bool = True, progress: Callable[[int], None] | None = None,
                     on_batch: Callable[[dict], None] | None = None) -> dict:
    """Run every configuration of `runners` (all wrapping `model`) on the same segments, in lockstep: each chunk
    of each batch of segments goes through the reference, then through every other configuration, whose logits and
    attention outputs are compared with the reference's at once (nothing per-vocabulary is kept across chunks).
    `kivi[name]` is each configuration's KIVI config (None for an unquantized cache); `progress(n)` is called
    with the number of scored tokens per configuration as chunks finish; `on_batch(result)` with the summary of
    the segments finished so far after each batch (checkpoints of a long run)."""
    if reference not in runners:
        raise ValueError(f"reference configuration {reference!r} is not among {sorted(runners)}")
    if len(token_ids) < setup.tokens_needed:
        raise ValueError(f"the corpus has {len(token_ids)} tokens; the setup needs {setup.tokens_needed} "
                         f"({setup.segments} segments of {setup.segment_len} from offset {setup.offset})")
    for name, r in runners.items():
        if r.max_seq_len < setup.segment_len - 1 or r.max_slots < min(setup.batch, setup.segments):
            raise ValueError(f"runner {name!r} holds {r.max_slots} x {r.max_seq_len} tokens; the setup needs "
                             f"{min(setup.batch, setup.segments)} x {setup.segment_len - 1}")
    cfgs = [c for c in kivi.values() if c is not None] or [KiviConfig()]
    plan = chunk_plan(setup.prefix, setup.segment_len - 1, cfgs, setup.max_chunk)
    order = [reference] + [n for n in runners if n != reference]
    n_seg, n_pos, p0 = setup.segments, setup.scored_per_segment, setup.prefix
    n_layers = model.cfg.n_layers if record_layers else 0
    f64 = torch.float64
    res = {n: {"nll": torch.zeros(n_seg, n_pos, dtype=f64), "kl": torch.zeros(n_seg, n_pos, dtype=f64),
               "top1": torch.zeros(n_seg, n_pos, dtype=torch.bool), "logit_err": torch.zeros(n_seg, n_pos, dtype=f64),
               "attn_err": torch.zeros(n_seg, n_layers, n_pos, dtype=f64)} for n in order}
    segs = [list(token_ids[setup.offset + i * setup.segment_len:setup.offset + (i + 1) * setup.segment_len])
            for i in range(n_seg)]
    ctx = record_attention_outputs(model) if record_layers else nullcontext(None)
    with ctx as rec_lists:
        rec = _Recorder(rec_lists)
        for b0 in range(0, n_seg, setup.batch):
            batch = list(range(b0, min(n_seg, b0 + setup.batch)))
            slots = {n: [runners[n].add_sequence() for _ in batch] for n in order}
            try:
                for n in order:  # prefill each segment's prefix (as one chunk per sequence)
                    runners[n].step(slots[n], [segs[i][:p0] for i in batch])
                rec.take()
                for s, e in plan:
                    c, i, j = e - s, s - p0, e - p0
                    chunk = [segs[k][s:e] for k in batch]
                    targets = torch.tensor([segs[k][s + 1:e + 1] for k in batch]).reshape(-1)  # [B * c]
                    ref = runners[reference].step(slots[reference], chunk, all_logits=True)  # [B * c, V]
                    ref_attn = rec.take()  # [layers, B * c, dim]
                    ref_lp, ref_top = log_probs(ref), ref.argmax(-1)
                    res[reference]["nll"][batch, i:j] = nll_from_log_probs(ref_lp, targets).view(len(batch), c)
                    for n in order[1:]:
                        out = runners[n].step(slots[n], chunk, all_logits=True)
                        attn = rec.take()
                        lp = log_probs(out)
                        rn = res[n]
                        rn["nll"][batch, i:j] = nll_from_log_probs(lp, targets).view(len(batch), c)
                        rn["kl"][batch, i:j] = kl_from_log_probs(ref_lp, lp).view(len(batch), c)
                        rn["top1"][batch, i:j] = (out.argmax(-1) == ref_top).view(len(batch), c)
                        rn["logit_err"][batch, i:j] = relative_error(ref, out).view(len(batch), c)
                        if record_layers and ref_attn is not None and attn is not None:  # [layers, B*c] -> [B, layers, c]
                            err = relative_error(ref_attn, attn).view(n_layers, len(batch), c)
                            rn["attn_err"][batch, :, i:j] = err.permute(1, 0, 2)
                    if progress:
                        progress(c * len(batch))
            finally:
                for n in order:
                    for sl in slots[n]:
                        runners[n].free_sequence(sl)
            if on_batch is not None and batch[-1] + 1 < n_seg:
                on_batch(_summarize(res, order, reference, setup, plan, kivi, record_layers, batch[-1] + 1))
    return _summarize(res, order, reference, setup, plan, kivi, record_layers)


def _summarize(res: dict[str, dict[str, torch.Tensor]], order: list[str], reference: str, setup: QualitySetup,
               plan, kivi: dict[str, KiviConfig | None], record_layers: bool, done: int | None = None) -> dict:
    """Summary over the first `done` segments (all by default)."""
    done = setup.segments if done is None else done
    res = {n: {k: v[:done] for k, v in r.items()} for n, r in res.items()}
    ref_ppl = perplexity(res[reference]["nll"].reshape(-1))
    configs, growth = {}, {}
    w = setup.max_chunk
    positions = list(range(setup.prefix, setup.segment_len - 1, w))  # first position of each bin
    for name in order:
        r = res[name]
        nlls = r["nll"].reshape(-1)
        cfg = kivi.get(name)
        row: dict = {"kv": name, "kivi": cfg.to_dict() if cfg is not None else None,
               "scored_tokens": int(nlls.numel()), "ppl": perplexity(nlls), "nll": float(nlls.mean())}
        row["ppl_delta_vs_ref"] = row["ppl"] - ref_ppl
        if name != reference:
            kl = r["kl"].reshape(-1)
            row |= {"kl_mean": float(kl.mean()), "kl_median": float(kl.median()),
                    "kl_p99": float(torch.quantile(kl, 0.99)),
                    "top1_agreement": float(r["top1"].double().mean()),
                    "logit_rel_err_mean": float(r["logit_err"].mean())}
            g = {"bin_start_positions": positions, "kl": _bin(r["kl"].mean(0), w),
                 "logit_rel_err": _bin(r["logit_err"].mean(0), w),
                 "top1_disagreement": _bin(1.0 - r["top1"].double().mean(0), w)}
            if record_layers:
                e = r["attn_err"].mean(0)  # [layers, N]: mean over segments
                g["attn_rel_err_by_layer"] = _bin(e, w)  # [layers][bins]
                g["attn_rel_err_mean_over_layers"] = _bin(e.mean(0), w)
                row["attn_rel_err_mean"] = float(e.mean())
                row["attn_rel_err_by_layer"] = e.mean(1).tolist()
            growth[name] = g
        configs[name] = row
    return {"reference": reference, "segments_done": done,
            "setup": asdict(setup) | {"scored_per_segment": setup.scored_per_segment,
            "chunks_per_segment": len(plan), "chunk_lengths": sorted({e - s for s, e in plan})},
            "configs": configs, "error_growth": growth}
