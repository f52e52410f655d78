"""Each checkpoint format's tensors for one linear layer, read into the canonical QWeight.

Owns: the tensor names and layouts of block/per-tensor FP8 (`weight_scale_inv`,
`weight_scale`), AutoAWQ GEMM (its interleaved nibble order), GPTQ (inputs packed along
qweight's rows, the zero - 1 convention of v1 checkpoints, act-order `g_idx`) and
compressed-tensors (`weight_packed` from pack_to_int32, zero points packed along the output
dim, naive int8, float8); every shape checked, a mismatch a ModelLoadError naming the tensor.
Does not know: which layers exist (weights.py asks per layer), slicing (QWeight does), kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.model.quantization.config import LinearScheme, Storage
from radixserve.model.quantization.qweight import Kind, QWeight
from radixserve.model_source import ModelLoadError

Read = Callable[[str], torch.Tensor]  # checkpoint tensor name -> the whole tensor
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column 8c + AWQ_ORDER[i]


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ModelLoadError(f"quantized weight {name!r}: {what}")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits codes each, the lowest bits first, along `dim` -> int64
    codes (that dim `32 / bits` times longer)."""
    per = 32 // bits
    mask = (1 << bits) - 1
    words = packed.to(torch.int64) & 0xFFFFFFFF  # unsigned view of the int32 words
    shifts = torch.arange(per, dtype=torch.int64) * bits
    if dim == 1:  # (R, C) -> (R, C, per) -> (R, C * per)
        return ((words[:, :, None] >> shifts) & mask).reshape(words.shape[0], -1)
    return ((words[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, words.shape[1])


def _as_groups(scale: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """A scale or zero point of one tensor (scalar), per channel (N, 1) / (N,) or per group
    (N, G) -> (N, G) float32."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, 1).contiguous()
    if s.dim() == 1:
        s = s[:, None]
    _check(s.shape[0] == n, name, f"shape {tuple(scale.shape)} does not match {n} outputs")
    return s.contiguous()


def _fp8(read: Read, p: str, scheme: LinearScheme) -> QWeight:
    w = read(p + ".weight")
    _check(w.dtype == torch.float8_e4m3fn, p + ".weight",
           f"dtype {w.dtype} (FP8 weights must be float8_e4m3fn)")
    n, k = w.shape
    codes = w.view(torch.uint8)
    if scheme.block is not None:
        bn, bk = scheme.block
        s = read(p + ".weight_scale_inv").float()
        want = (-(-n // bn), -(-k // bk))
        _check(tuple(s.shape) == want, p + ".weight_scale_inv",
               f"shape {tuple(s.shape)}, expected {want} for blocks {bn}x{bk}")
        rows = s.repeat_interleave(bn, dim=0)[:n]  # (N, ceil(K / bk)): partial blocks kept
        return QWeight(Kind.FP8, codes, rows.contiguous(), None, bk)
    s = _as_groups(read(p + ".weight_scale"), n, p + ".weight_scale")
    _check(s.shape[1] == 1, p + ".weight_scale", "per-group FP8 scales")
    return QWeight(Kind.FP8, codes, s, None, k)


def _awq(read: Read, p: str, scheme: LinearScheme) -> QWeight:
    qweight, qzeros, scales = read(p + ".qweight"), read(p + ".qzeros"), read(p + ".scales")
    k = qweight.shape[0]
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.argsort(order)  # the position of column j within its word

    def columns(packed: torch.Tensor) -> torch.Tensor:  # (R, C) int32 -> (R, 8C) codes
        raw = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)  # by nibble
        return raw[:, :, inverse].reshape(packed.shape[0], -1)  # by column

    codes = columns(qweight)  # (K, N)
    n = codes.shape[1]
    group = k if scheme.group_size <= 0 else scheme.group_size
    groups = -(-k // group)
    _check(tuple(scales.shape) == (groups, n), p + ".scales",
           f"shape {tuple(scales.shape)}, expected {(groups, n)}")
    zeros = columns(qzeros)
    _check(tuple(zeros.shape) == (groups, n), p + ".qzeros", f"{tuple(qzeros.shape)}")
    return QWeight(Kind.INT4, codes.t().to(torch.uint8).contiguous(),
                   scales.float().t().contiguous(), zeros.float().t().contiguous(), group)


def _gptq(read: Read, p: str, scheme: LinearScheme, has: Callable[[str], bool]) -> QWeight:
    bits = scheme.bits
    qweight, qzeros, scales = read(p + ".qweight"), read(p + ".qzeros"), read(p + ".scales")
    codes = unpack_int32(qweight, bits, dim=0)  # (K, N)
    k, n = codes.shape
    group = k if scheme.group_size <= 0 else scheme.group_size
    groups = -(-k // group)
    _check(tuple(scales.shape) == (groups, n), p + ".scales",
           f"shape {tuple(scales.shape)}, expected {(groups, n)}")
    zeros = unpack_int32(qzeros, bits, dim=1)[:, :n]  # (G, N)
    if scheme.zero_plus_one:
        zeros = zeros + 1
    perm = None
    if has(p + ".g_idx"):
        g_idx = read(p + ".g_idx").to(torch.int64)
        _check(g_idx.shape == (k,), p + ".g_idx", f"shape {tuple(g_idx.shape)}")
        if not torch.equal(g_idx, torch.arange(k) // group):  # act-order: group by g_idx
            counts = torch.bincount(g_idx, minlength=groups)
            full = torch.full((groups,), group, dtype=counts.dtype)
            full[-1] = k - group * (groups - 1)
            _check(torch.equal(counts, full), p + ".g_idx", "groups of unequal sizes")
            perm = torch.argsort(g_idx, stable=True)
            codes = codes[perm]
    return QWeight(Kind.INT4 if bits == 4 else Kind.INT8, codes.t().to(torch.uint8).contiguous(),
                   scales.float().t().contiguous(), zeros.float().t().contiguous(), group, perm)


def _ct_packed(read: Read, p: str, scheme: LinearScheme, has: Callable[[str], bool]
               ) -> QWeight:
    bits = scheme.bits
    shape = read(p + ".weight_shape").tolist()
    n, k = int(shape[0]), int(shape[1])
    codes = unpack_int32(read(p + ".weight_packed"), bits, dim=1)[:, :k]  # (N, K) unsigned
    _check(codes.shape[0] == n, p + ".weight_packed", f"{n} rows expected")
    scale = _as_groups(read(p + ".weight_scale"), n, p + ".weight_scale")
    group = k if scale.shape[1] == 1 else scheme.group_size
    _check(scale.shape[1] == -(-k // group), p + ".weight_scale", f"{scale.shape[1]} groups")
    offset = float(1 << (bits - 1))  # pack_to_int32 stored value + 2^(bits-1)
    if not scheme.symmetric and has(p + ".weight_zero_point"):
        zp = read(p + ".weight_zero_point")
        if zp.dtype == torch.int32:  # packed along the output dim, offset like the codes
            zero = unpack_int32(zp, bits, dim=0)[:n].float()
        else:
            zero = _as_groups(zp, n, p + ".weight_zero_point") + offset
        _check(zero.shape == scale.shape, p + ".weight_zero_point", f"{tuple(zero.shape)}")
    else:
        zero = torch.full_like(scale, offset)
    return QWeight(Kind.INT4 if bits == 4 else Kind.INT8, codes.to(torch.uint8), scale,
                   zero.contiguous(), group)


def _ct_naive(read: Read, p: str, scheme: LinearScheme, has: Callable[[str], bool]
              ) -> QWeight:
    w = read(p + ".weight")
    _check(w.dtype == torch.int8, p + ".weight", f"dtype {w.dtype}, expected int8")
    n, k = w.shape
    scale = _as_groups(read(p + ".weight_scale"), n, p + ".weight_scale")
    group = k if scale.shape[1] == 1 else scheme.group_size
    _check(scale.shape[1] == -(-k // group), p + ".weight_scale", f"{scale.shape[1]} groups")
    zp = torch.zeros_like(scale)
    if has(p + ".weight_zero_point"):
        zp = _as_groups(read(p + ".weight_zero_point"), n, p + ".weight_zero_point")
    codes = (w.to(torch.int16) + 128).to(torch.uint8)  # signed -> unsigned codes
    return QWeight(Kind.INT8, codes, scale, (zp + 128).contiguous(), group)


def read_qweight(read: Read, has: Callable[[str], bool], prefix: str, scheme: LinearScheme
                 ) -> QWeight:
    """Linear layer `prefix` (e.g. "layers.0.self_attn.q_proj") in its checkpoint format."""
    s = scheme.storage
    if s in (Storage.FP8, Storage.CT_FLOAT):
        return _fp8(read, prefix, scheme)
    if s is Storage.AWQ:
        return _awq(read, prefix, scheme)
    if s is Storage.GPTQ:
        return _gptq(read, prefix, scheme, has)
    if s is Storage.CT_PACKED:
        return _ct_packed(read, prefix, scheme, has)
    return _ct_naive(read, prefix, scheme, has)
