"""The fragment and tensor-core arithmetic shared by the CPU emulations of the attention kernels (mma_model.py:
kiviDecodeMma.cuh; prefill_model.py: kiviPrefillMma.cuh).

  - the PTX ISA's mma.m16n8k16 fragment layouts (g = lane >> 2, t = lane & 3; A: row g + 8 (r & 1), col
    2t + 8 (r >> 1) + {0,1}; B: k 2t + 8 r + {0,1}, n g; C: row g + 8 (r >> 1), col 2t + (r & 1)), the kernel's
    register assignment of a FRAGMENT-order word, and movmatrix.m8n8.trans;
  - the bit conversion of packed codes into fp16 / bf16 registers (one shift + one lop3: 1 + c 2^-b exactly);
  - the tensor-core product (exact products, float64 sum, one rounding to fp32 per MMA), fp32 / activation-dtype
    rounding and ex2;
  - CtaInputs: the cache buffers as one CTA of either kernel reads them.
"""

from __future__ import annotations

import numpy as np
import torch

from ..format import ONE_BF16, ONE_FP16, KiviConfig, fragment_words_per_lane
from ..reference.attention import KiviBuffers

LOG2E = 1.4426950408889634
ONE_BITS = {torch.float16: ONE_FP16, torch.bfloat16: ONE_BF16}
MANTISSA = {torch.float16: 10, torch.bfloat16: 7}

# ---------------------------------------------------------------------------------------------- fragments (PTX ISA)


def a_coord(lane: np.ndarray, reg: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of element `half` of A register `reg` (m16n8k16, .f16/.bf16, row-major A)."""
    g, t = lane >> 2, lane & 3
    return g + 8 * (reg & 1), 2 * t + half + 8 * (reg >> 1)


def b_coord(lane: np.ndarray, reg: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    """(k, n) of element `half` of B register `reg` (col-major B)."""
    g, t = lane >> 2, lane & 3
    return 2 * t + half + 8 * reg, g


def c_coord(lane: np.ndarray, reg: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of fp32 accumulator register `reg`."""
    g, t = lane >> 2, lane & 3
    return g + 8 * (reg >> 1), 2 * t + (reg & 1)


def register_of(j: int, pos: int, bits: int) -> tuple[int, int]:
    """The kernel's register assignment: word j, bit position pos -> (16-wide block, A register)."""
    pi = j * (16 // bits) + pos
    return pi // 4, pi % 4


def movmatrix_trans(x: np.ndarray) -> np.ndarray:
    """movmatrix.sync.aligned.m8n8.trans.b16: x [32 lanes, 2] holds M[lane // 4][2 (lane % 4) + i]; returns the
    same layout of M^T (lane L gets M[2 (L % 4) + i][L // 4])."""
    lane = np.arange(32)
    out = np.empty_like(x)
    for i in range(2):
        src_row, src_col = 2 * (lane % 4) + i, lane // 4
        out[:, i] = x[src_row * 4 + src_col // 2, src_col % 2]
    return out


# ---------------------------------------------------------------------------------------------- bit conversion


def _bits_to_float(h: np.ndarray, act: torch.dtype) -> np.ndarray:
    """16-bit patterns (uint32 holding them) -> float32 values of `act`."""
    if act == torch.float16:
        return h.astype(np.uint16).view(np.float16).astype(np.float32)
    return (h.astype(np.uint32) << np.uint32(16)).view(np.float32)  # bf16 = the top half of an fp32


def code_affine(act: torch.dtype, bits: int) -> tuple[float, float]:
    """(alpha, beta): a converted register element is alpha + beta * code, exactly."""
    if act == torch.bfloat16 and bits == 8:
        return 0.0, 1.0
    return 1.0, 2.0 ** -bits


def convert_register(words: np.ndarray, pos: int, bits: int, act: torch.dtype) -> np.ndarray:
    """The register of bit position `pos`: words uint32 [...] -> float32 [..., 2] (low half, high half).

    fp16 / bf16 (b < 8): shift the word so that the codes at bits [p b, (p+1) b) of each half land on mantissa bits
    [m - b, m) (m = 10 or 7), then lop3: (x & mask) | ONE ONE, i.e. exactly 1 + c 2^-b per half."""
    w = words.astype(np.uint64)
    alpha, _ = code_affine(act, bits)
    if alpha == 0.0:  # bf16, 8-bit codes: cvt through fp32 (exact: c < 256 has 8 significant bits)
        lo = (w >> np.uint64(pos * bits)) & np.uint64(0xFF)
        hi = (w >> np.uint64(16 + pos * bits)) & np.uint64(0xFF)
        return np.stack([lo, hi], axis=-1).astype(np.float32)
    m = MANTISSA[act]
    shift = (m - bits) - pos * bits  # left when positive
    x = (w << np.uint64(shift)) if shift >= 0 else (w >> np.uint64(-shift))
    x &= np.uint64(0xFFFFFFFF)
    mask = (((1 << bits) - 1) << (m - bits)) * 0x00010001
    one = ONE_BITS[act] * 0x00010001
    r = (x & np.uint64(mask)) | np.uint64(one)
    return np.stack([_bits_to_float(r & np.uint64(0xFFFF), act), _bits_to_float(r >> np.uint64(16), act)], axis=-1)


def unpack_tile(words: np.ndarray, bits: int, head_dim: int, act: torch.dtype) -> np.ndarray:
    """One FRAGMENT-order tile: words uint32 [32 lanes, nw] -> registers [D / 16, 32, 4, 2] (float32 values)."""
    nw = fragment_words_per_lane(head_dim, bits)
    regs = np.zeros((head_dim // 16, 32, 4, 2), np.float32)
    for j in range(nw):
        for pos in range(16 // bits):
            blk, reg = register_of(j, pos, bits)
            regs[blk, :, reg] = convert_register(words[:, j], pos, bits, act)
    return regs


def assemble_a(regs: np.ndarray) -> np.ndarray:
    """registers [blocks, 32, 4, 2] -> the A matrices [blocks, 16, 16] they are (PTX A layout)."""
    lane = np.arange(32)
    a = np.zeros((regs.shape[0], 16, 16), np.float32)
    for reg in range(4):
        for half in range(2):
            row, col = a_coord(lane, reg, half)
            a[:, row, col] = regs[:, :, reg, half]
    return a


def p_to_b_fragment(p16: np.ndarray) -> np.ndarray:
    """P [16 keys, 8 heads] already rounded to the MMA type, as the kernel moves it: C-fragment registers
    (c0, c1 = keys g, heads 2t, 2t+1; c2, c3 = keys g + 8) packed to two b16x2 registers, movmatrix.trans each,
    giving B registers b0 (keys 2t, 2t+1; head g) and b1 (keys 8 + 2t, +1) -> the B matrix [16 keys, 8 heads]."""
    lane = np.arange(32)
    c = np.zeros((32, 4), np.float32)
    for reg in range(4):
        row, col = c_coord(lane, reg)
        c[:, reg] = p16[row, col]
    b_regs = [movmatrix_trans(c[:, 0:2]), movmatrix_trans(c[:, 2:4])]
    b = np.zeros((16, 8), np.float32)
    for reg in range(2):
        for half in range(2):
            k, n = b_coord(lane, reg, half)
            b[k, n] = b_regs[reg][:, half]
    return b


# ---------------------------------------------------------------------------------------------- arithmetic


def mma(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """D = A B + C: exact products, float64 sum, one rounding to fp32 (a model of the tensor core)."""
    return (c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def round_to(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fp32 -> dtype (round to nearest even) -> fp32, as roundToAct / storeScale."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dtype).float().numpy()


def exp2(x: np.ndarray) -> np.ndarray:
    """2^x rounded once to fp32 (a model of ex2.approx, which is within 2^-22)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp2(x.astype(np.float64)).astype(np.float32)


class CtaInputs:
    """Everything one CTA of either attention kernel reads: buffers (codes as uint32 words, scales, zeros and
    windows in fp32), config, activation dtype, head_dim."""

    def __init__(self, buffers: KiviBuffers, cfg: KiviConfig, act: torch.dtype, d: int) -> None:
        self.buf, self.cfg, self.act, self.d = buffers, cfg, act, d
        self.gv = cfg.value_group_size(d)
        self.k_words = buffers.k_codes.numpy().view(np.uint32).reshape(buffers.k_codes.shape[0],
                                                                      buffers.k_codes.shape[1], -1)
        self.v_words = buffers.v_codes.numpy().view(np.uint32).reshape(buffers.v_codes.shape[0],
                                                                      buffers.v_codes.shape[1], -1)
        self.ks, self.kz = buffers.k_scale.float().numpy(), buffers.k_zero.float().numpy()
        self.vs, self.vz = buffers.v_scale.float().numpy(), buffers.v_zero.float().numpy()
        self.kwin, self.vwin = buffers.k_window.float().numpy(), buffers.v_window.float().numpy()
