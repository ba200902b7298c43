"""A compact Llama (gpt-fast style): RMSNorm, RoPE (rope_theta, linear / Llama-3 scaling), GQA attention whose K/V
live in a KV cache (trtllm_kivi.cache: KiviCache or FullCache), SwiGLU MLP, tied or untied embeddings; optional
q/k/v projection biases (the Qwen2 family: a Llama with `qkv_bias`).

A forward pass runs one step of a ragged batch: the tokens of all sequences are concatenated ([T] ids, T = sum of
the chunk lengths), every op except attention is per token, and attention is the cache's
`cache.attention(layer, q, k, v, step)` (attend to the stored state + the chunk, then append). No padding exists.
A cache whose format rotates a layer (format.py: k_rotation / v_rotation) gets that layer's q/k/v times H and its
output is multiplied by H^T here, at run time, so one loaded model serves every configuration of an evaluation.
Weights use Hugging Face names at the boundary (`from_hf_state_dict`); q/k/v and gate/up are fused inside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..format import Geometry
from ..reference.rotation import rotate, unrotate

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    """Llama hyper-parameters (Hugging Face LlamaConfig names in comments)."""

    vocab_size: int
    dim: int  # hidden_size
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads
    head_dim: int
    ffn_dim: int  # intermediate_size
    norm_eps: float = 1e-5  # rms_norm_eps
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...} or None
    max_seq_len: int = 2048  # max_position_embeddings
    tie_embeddings: bool = False  # tie_word_embeddings
    qkv_bias: bool = False  # biases on q_proj/k_proj/v_proj (Qwen2; o_proj and the MLP have none)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"
    extra: dict = field(default_factory=dict, repr=False)  # e.g. GGUF metadata worth keeping

    def __post_init__(self) -> None:
        for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"model config: {k}={v!r} must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model config: n_heads={self.n_heads} must be a multiple of n_kv_heads="
                             f"{self.n_kv_heads}")
        if self.head_dim % 32:  # the KIVI cache packs whole int32 words per head (format.KiviConfig.check_head_dim)
            raise ValueError(f"model config: head_dim={self.head_dim} is not supported; allowed: a multiple of 32 "
                             f"(64 and 128 have CUDA kernels)")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"model config: norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must be > 0")
        rope_inv_freq(self)  # validates rope_scaling

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32), with linear or Llama-3 scaling (as in HF's rope init)."""
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; allowed: {', '.join(ROPE_TYPES)}")
    try:
        if kind == "linear":
            inv = inv / float(s["factor"])
        elif kind == "llama3":
            factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
            old = float(s["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old / lo, inv / factor, inv)  # long wavelengths: slowed down by factor
            smooth = (old / wavelen - lo) / (hi - lo)  # in between: interpolate
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old / hi) & (wavelen <= old / lo)
            inv = torch.where(medium, smoothed, scaled)
    except KeyError as e:
        raise ValueError(f"rope_scaling {kind!r} is missing the key {e.args[0]!r}") from None
    if "rope_freqs" in cfg.extra:  # GGUF Llama-3 files store the scaling as per-frequency divisors [D/2]
        inv = inv / cfg.extra["rope_freqs"].float().to(inv.device)
    return inv


def _weight(*shape: int) -> nn.Parameter:
    """An uninitialized weight: models are built from checkpoints (from_hf_state_dict), so random init is waste."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps, self.weight = eps, _weight(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, dim]; normalized in fp32 like HF
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (HF's half-split layout), cos/sin [T, D] -> rotated x."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.h, self.hkv, self.d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = _weight((self.h + 2 * self.hkv) * self.d, cfg.dim)  # rows: q | k | v
        self.bqkv = _weight((self.h + 2 * self.hkv) * self.d) if cfg.qkv_bias else None  # q | k | v, or None
        self.wo = _weight(cfg.dim, self.h * self.d)

    def forward(self, x, cos, sin, layer: int, cache, step) -> torch.Tensor:  # x [T, dim]
        t = x.shape[0]
        q, k, v = F.linear(x, self.wqkv, self.bqkv).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d],
                                                         dim=-1)
        q = apply_rope(q.view(t, self.h, self.d), cos, sin)  # [T, H, D]
        k = apply_rope(k.view(t, self.hkv, self.d), cos, sin)  # [T, Hkv, D]
        v = v.view(t, self.hkv, self.d)
        # The cache's format says whether this layer's K / V are stored Hadamard-rotated (format.py); the op never
        # sees it: q and k rotate together (scores unchanged), v rotates and the output rotates back.
        k_rot, v_rot = cache.rotations(layer) if hasattr(cache, "rotations") else ("none", "none")
        q, k, v = rotate(q, k_rot), rotate(k, k_rot), rotate(v, v_rot)
        out = cache.attention(layer, q, k, v, step)  # [T, H, D], fp32 softmax inside
        out = unrotate(out, v_rot)
        return F.linear(out.reshape(t, self.h * self.d), self.wo)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w13 = _weight(2 * cfg.ffn_dim, cfg.dim)  # rows: gate | up
        self.w2 = _weight(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # SwiGLU: down(silu(gate(x)) * up(x))
        gate, up = F.linear(x, self.w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim, cfg.norm_eps), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim, cfg.norm_eps), MLP(cfg)

    def forward(self, x, cos, sin, layer: int, cache, step) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, layer, cache, step)
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _weight(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else _weight(cfg.vocab_size, cfg.dim)
        self.inv_freq = rope_inv_freq(cfg)  # [D/2] fp32; a plain attribute so .to(dtype) never rounds it
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos/sin tables [positions, D], grown on demand

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def rope_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [>= n, D] in the model dtype, computed in fp32 once and reused (doubling when outgrown)."""
        if self._rope is None or self._rope[0].shape[0] < n or self._rope[0].dtype != self.dtype \
                or self._rope[0].device != self.device:
            n = max(n, 4096, 2 * (0 if self._rope is None else self._rope[0].shape[0]))
            pos = torch.arange(n, device=self.device, dtype=torch.float32)
            freqs = torch.outer(pos, self.inv_freq.to(self.device))
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
            self._rope = (emb.cos().to(self.dtype), emb.sin().to(self.dtype))
        return self._rope

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, step,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens/positions [T] (sequences concatenated, as `step` lists them) -> fp32 logits [T, vocab], or
        [len(logit_rows), vocab] for the rows in logit_rows only (e.g. each chunk's last token)."""
        cos, sin = self.rope_tables(int(positions.max()) + 1)
        cos, sin = cos[positions], sin[positions]  # [T, D]
        x = F.embedding(tokens, self.embed)  # [T, dim]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, cache, step)
        if logit_rows is not None:
            x = x[logit_rows]
        x = self.norm(x)
        return F.linear(x, self.embed if self.lm_head is None else self.lm_head).float()

    # ------------------------------------------------------------------------------------------- weights

    @staticmethod
    def hf_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor a Hugging Face Llama (or, with qkv_bias, Qwen2) checkpoint must have, with its shape."""
        h, hkv, d, dim, f = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim, cfg.ffn_dim
        shapes = {"model.embed_tokens.weight": (cfg.vocab_size, dim), "model.norm.weight": (dim,)}
        if not cfg.tie_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, dim)
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            shapes |= {p + "input_layernorm.weight": (dim,), p + "post_attention_layernorm.weight": (dim,),
                       p + "self_attn.q_proj.weight": (h * d, dim), p + "self_attn.k_proj.weight": (hkv * d, dim),
                       p + "self_attn.v_proj.weight": (hkv * d, dim), p + "self_attn.o_proj.weight": (dim, h * d),
                       p + "mlp.gate_proj.weight": (f, dim), p + "mlp.up_proj.weight": (f, dim),
                       p + "mlp.down_proj.weight": (dim, f)}
            if cfg.qkv_bias:
                shapes |= {p + "self_attn.q_proj.bias": (h * d,), p + "self_attn.k_proj.bias": (hkv * d,),
                           p + "self_attn.v_proj.bias": (hkv * d,)}
        return shapes

    @classmethod
    def from_hf_state_dict(cls, cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                           device: str | torch.device = "cpu", release: bool = False) -> LlamaModel:
        """Build from Hugging Face-named weights (checked: every tensor present with its shape, none unknown).
        release=True removes each tensor from `sd` once the model holds it (peak memory near one copy)."""
        expected = cls.hf_weight_shapes(cfg)
        missing = [n for n in expected if n not in sd]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()  # some tied checkpoints still store it
        unknown = [n for n in sd if n not in expected and n not in ignored and not n.endswith("rotary_emb.inv_freq")]
        if unknown:
            raise ValueError(f"checkpoint has unsupported tensor(s) {unknown[:3]} (not a plain Llama or Qwen2 "
                             f"checkpoint of its config.json / GGUF architecture)")
        for n, shape in expected.items():
            if tuple(sd[n].shape) != shape:
                raise ValueError(f"tensor {n} has shape {tuple(sd[n].shape)}, expected {shape}")
        model = cls(cfg)  # empty weights (never touched: no memory until replaced below)

        def put(param: nn.Parameter, *names: str) -> None:
            parts = [sd.pop(n) if release else sd[n] for n in names]
            whole = parts[0] if len(parts) == 1 and release else torch.cat(parts, dim=0)  # never alias sd's tensors
            param.data = whole.to(device=device, dtype=dtype)

        put(model.embed, "model.embed_tokens.weight")
        put(model.norm.weight, "model.norm.weight")
        if model.lm_head is not None:
            put(model.lm_head, "lm_head.weight")
        blocks: list[Block] = list(model.layers)  # type: ignore[arg-type]  # an nn.ModuleList of Block
        for i, b in enumerate(blocks):
            p = f"model.layers.{i}."
            put(b.attn_norm.weight, p + "input_layernorm.weight")
            put(b.mlp_norm.weight, p + "post_attention_layernorm.weight")
            put(b.attn.wqkv, *(p + f"self_attn.{x}_proj.weight" for x in "qkv"))
            if b.attn.bqkv is not None:
                put(b.attn.bqkv, *(p + f"self_attn.{x}_proj.bias" for x in "qkv"))
            put(b.attn.wo, p + "self_attn.o_proj.weight")
            put(b.mlp.w13, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            put(b.mlp.w2, p + "mlp.down_proj.weight")
        return model.eval().requires_grad_(False)
