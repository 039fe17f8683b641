"""Number formats of the checkpoint, in numpy: E2M1 (MXFP4 codes), E8M0 scales, FP8 E4M3, bf16.

- E2M1: two codes per byte, element 2i in the low nibble. Codes 0-7 are
  0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8-15 the same negated (8 is -0.0).
- E8M0: a byte b is 2^(b-127); b = 255 is NaN.
- FP8 trunk linears: E4M3 values with one E8M0 scale per 128x128 tile. E4M3 x 2^k is
  exact in bf16 unless it under- or overflows; `dequantize_fp8` checks that it is.

These are the reference decodes (slow, exact); the hot path is in the native kernels.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ds4f.engine.model.geometry import FP8_TILE
from ds4f.errors import Ds4fError

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
E8M0_NAN = 255

# safetensors dtype code -> (numpy dtype, the name safetensors' TensorSpec accepts)
ST_DTYPES: dict[str, tuple[np.dtype, str]] = {
    "BOOL": (np.dtype(bool), "bool"),
    "U8": (np.dtype(np.uint8), "uint8"),
    "I8": (np.dtype(np.int8), "int8"),
    "I16": (np.dtype("<i2"), "int16"),
    "U16": (np.dtype("<u2"), "uint16"),
    "I32": (np.dtype("<i4"), "int32"),
    "U32": (np.dtype("<u4"), "uint32"),
    "I64": (np.dtype("<i8"), "int64"),
    "U64": (np.dtype("<u8"), "uint64"),
    "F16": (np.dtype("<f2"), "float16"),
    "F32": (np.dtype("<f4"), "float32"),
    "F64": (np.dtype("<f8"), "float64"),
    "BF16": (BF16, "bfloat16"),
    "F8_E4M3": (E4M3, "float8_e4m3fn"),
    "F8_E5M2": (np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2"),
    "F8_E8M0": (E8M0, "float8_e8m0fnu"),
}


def st_numpy_dtype(code: str) -> np.dtype:
    return ST_DTYPES[code][0]


def st_itemsize(code: str) -> int:
    return ST_DTYPES[code][0].itemsize


# ---- E2M1 -------------------------------------------------------------------------
def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """uint8/int8 [..., k/2] -> codes uint8 [..., k] (element 2i from the low nibble)."""
    b = np.asarray(packed).view(np.uint8)
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = b & 0x0F
    out[..., 1::2] = b >> 4
    return out


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """codes uint8 [..., k] (0..15) -> uint8 [..., k/2]."""
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2:
        raise ValueError("E2M1 rows need an even number of elements")
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def e8m0_to_f32(scales: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 2^(b-127) (b=0 gives the subnormal 2^-127; b=255 NaN)."""
    b = np.asarray(scales).view(np.uint8).astype(np.uint32)
    out = np.where(b == 0, np.uint32(0x00400000), b << 23).view(np.float32)
    return np.where(b == E8M0_NAN, np.float32(np.nan), out)


def dequantize_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 codes [rows, k/2] + E8M0 scales [rows, k/32] -> float32 [rows, k] (exact)."""
    vals = E2M1_VALUES[unpack_e2m1(packed)]
    rows, k = vals.shape
    s = e8m0_to_f32(scales).reshape(rows, k // 32, 1)
    return (vals.reshape(rows, k // 32, 32) * s).reshape(rows, k)


# ---- FP8 E4M3 with 128x128 E8M0 tiles ----------------------------------------------
def dequantize_fp8(weight: np.ndarray, scale: np.ndarray, *, name: str = "tensor",
                   out: np.ndarray | None = None, chunk_rows: int = 512) -> np.ndarray:
    """E4M3 [r, c] x E8M0 tiles [ceil(r/128), ceil(c/128)] -> bf16 [r, c], exactly or a Ds4fError.

    E4M3 x 2^k is exact in bf16 unless it under- or overflows; every value is checked
    (the float32 product is undone and compared, then its bf16 rounding compared), and a
    NaN value or scale is refused. Works through `chunk_rows` rows at a time.
    """
    w = np.asarray(weight).view(E4M3)
    if w.ndim != 2:
        raise Ds4fError(f"{name}: FP8 dequantization needs a 2-D weight, got shape {list(w.shape)}")
    r, c = w.shape
    sb = np.asarray(scale).view(np.uint8)
    tile = FP8_TILE
    if sb.shape != (-(-r // tile), -(-c // tile)):
        raise Ds4fError(f"{name}: scale shape {list(sb.shape)} does not tile a {r}x{c} weight in "
                        f"{tile}x{tile} blocks (expected {[-(-r // tile), -(-c // tile)]})")
    if np.any(sb == E8M0_NAN):
        raise Ds4fError(f"{name}: NaN scale byte (0xFF) in its FP8 scale tiles")
    res = np.empty((r, c), dtype=BF16) if out is None else out
    chunk_rows = max(tile, chunk_rows - chunk_rows % tile)
    for r0 in range(0, r, chunk_rows):
        r1 = min(r, r0 + chunk_rows)
        exps = sb[np.arange(r0, r1) // tile].astype(np.int32) - 127
        exps = np.repeat(exps, tile, axis=1)[:, :c]
        v = w[r0:r1].astype(np.float32)
        p = np.ldexp(v, exps)
        q = p.astype(BF16)
        res[r0:r1] = q
        bad = ~np.isfinite(p) | (np.ldexp(p, -exps) != v) | (q.astype(np.float32) != p)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise Ds4fError(
                f"{name}: FP8 value at [{r0 + i}, {j}] = {float(v[i, j])!r} x 2^{int(exps[i, j])}"
                f" is not exactly representable in bf16 ({int(bad.sum())} such values in rows {r0}..{r1 - 1})")
    return res


def quantize_fp8(w: np.ndarray, tile: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """float32 [r, c] -> (E4M3 [r, c], E8M0 tiles): per tile scale 2^ceil(log2(amax/448))."""
    r, c = w.shape
    R, C = -(-r // tile), -(-c // tile)
    pad = np.zeros((R * tile, C * tile), np.float32)
    pad[:r, :c] = w
    amax = np.abs(pad.reshape(R, tile, C, tile)).max(axis=(1, 3))
    amax = np.maximum(amax, np.float32(2.0 ** -100))
    e = np.ceil(np.log2(amax / 448.0)).astype(np.int32)
    e = np.clip(e, -127, 127)
    scale_bytes = (e + 127).astype(np.uint8)
    inv = np.ldexp(np.float32(1.0), -e).astype(np.float32)
    inv_full = np.repeat(np.repeat(inv, tile, axis=0), tile, axis=1)[:r, :c]
    q = (w * inv_full).astype(E4M3)
    return q, scale_bytes.view(E8M0)




def non_finite(arr) -> int:
    """How many NaN or infinite values a tensor holds, in its stored dtype (fp32, bf16, fp8, the
    e8m0 scales); 0 for integer and boolean tensors."""
    a = np.asarray(arr)
    if a.dtype.kind in "biu":
        return 0
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def check_finite(arr, name: str, path) -> None:
    """A Ds4fError naming the tensor and the checkpoint when `arr` holds a NaN or an infinity
    (for the tensors no output check reaches: a value there reroutes tokens silently)."""
    bad = non_finite(arr)
    if bad:
        raise Ds4fError(f"{path}: tensor {name} holds {bad} non-finite values (NaN or infinity);"
                        f" `ds4f verify {path}` lists every such tensor", path=path)
