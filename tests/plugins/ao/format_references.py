"""Reference quantizers for the block formats, written from the format descriptions alone, one
value at a time in plain Python floats and numpy float32, with the element and scale formats
enumerated from their bit layouts. They share no code with lowbit-ao or torchao, so the tests
that compare them bit for bit can fail.

MXFP8 follows the OCP Microscaling Formats (MX) Specification v1.0, section 6.3: for each block of
32 values, ``shared_exp = floor(log2(max|v|)) - emax_elem`` (E4M3: emax_elem = 8), the scale
``X = 2^shared_exp`` is stored as E8M0 (an exponent in [-127, 127]), and each element is
``v / X`` rounded to E4M3 (nearest, ties to even), saturating at the largest normal (448).
The ``rceil`` variant rounds ``amax / 448`` up to a power of two instead (NVIDIA's hardware
cast), so no element exceeds 448.

NVFP4 follows NVIDIA's description of the format: E2M1 elements, one E4M3 scale per 16
consecutive values, and a per-tensor fp32 scale ``s = 448 * 6 / amax(tensor)``. A block's stored
scale is ``e4m3(amax(block) / 6 * s)``; its elements are ``v / (stored / s)`` rounded to E2M1
(nearest, ties to even), saturating at 6. Weights may share one scale per 16x16 tile instead.
"""

from __future__ import annotations

import math

import numpy as np


def _fp8_e4m3fn_values() -> list[tuple[int, float]]:
    """Every finite non-negative E4M3 value with its bit pattern: 4 exponent bits (bias 7),
    3 mantissa bits, subnormals at exponent 0, and no infinity (S.1111.111 is NaN)."""
    out = []
    for bits in range(0x7F):  # 0x7F is NaN
        exponent, mantissa = bits >> 3, bits & 0b111
        value = (mantissa / 8) * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        out.append((bits, value))
    return out


def _e2m1_values() -> list[tuple[int, float]]:
    """The 8 non-negative E2M1 values: 2 exponent bits (bias 1), 1 mantissa bit, subnormal at 0."""
    out = []
    for bits in range(8):
        exponent, mantissa = bits >> 1, bits & 1
        value = (mantissa / 2) * 1.0 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
        out.append((bits, value))
    return out


E4M3 = _fp8_e4m3fn_values()
E2M1 = _e2m1_values()


def round_to_table(value: float, table: list[tuple[int, float]]) -> float:
    """Nearest value of ``table`` to ``value``, ties to the even bit pattern, saturating at the top."""
    magnitude = min(abs(value), table[-1][1])
    best = min(table, key=lambda entry: (abs(entry[1] - magnitude), entry[0] & 1))
    return math.copysign(best[1], value) if value != 0 else 0.0


def mxfp8_quantize(row: list[float], rounding: str = "floor") -> tuple[list[int], list[float]]:
    """One row (length a multiple of 32) -> (E8M0 exponents per block, E4M3 element values)."""
    exponents, elements = [], []
    for start in range(0, len(row), 32):
        block = row[start : start + 32]
        amax = max(abs(v) for v in block)
        if amax == 0:
            shared = -127
        elif rounding == "floor":
            mantissa, exponent = math.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
            shared = (exponent - 1) - 8
        else:
            ratio = amax / 448.0
            mantissa, exponent = math.frexp(ratio)
            shared = exponent - 1 if mantissa == 0.5 else exponent  # ceil(log2(ratio))
        shared = max(-127, min(127, shared))
        exponents.append(shared)
        elements += [round_to_table(v / 2.0**shared, E4M3) for v in block]
    return exponents, elements


def nvfp4_quantize(matrix: np.ndarray, two_d: bool = False) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """A float32 (rows, cols) matrix -> (E2M1 values, E4M3 block scales, the fp32 tensor scale).
    Arithmetic in float32, as the format's scales are stored."""
    matrix = matrix.astype(np.float32)
    rows, cols = matrix.shape
    amax = np.float32(np.abs(matrix).max())
    tensor_scale = np.float32(np.float32(448.0 * 6.0) / amax) if amax > 0 else np.float32(1.0)
    values = np.zeros_like(matrix)
    tile_rows = 16 if two_d else 1
    scales = np.zeros((rows // tile_rows, cols // 16), dtype=np.float32)
    for r0 in range(0, rows, tile_rows):
        for c0 in range(0, cols, 16):
            block = matrix[r0 : r0 + tile_rows, c0 : c0 + 16]
            block_amax = np.float32(np.abs(block).max())
            wanted = np.float32(np.float32(block_amax / np.float32(6.0)) * tensor_scale)
            stored = np.float32(round_to_table(float(min(wanted, np.float32(448.0))), E4M3))
            scales[r0 // tile_rows, c0 // 16] = stored
            decode = np.float32(stored / tensor_scale)
            for i in range(block.shape[0]):
                for j in range(16):
                    scaled = np.float32(block[i, j] / decode) if decode > 0 else np.float32(0.0)
                    values[r0 + i, c0 + j] = round_to_table(float(scaled), E2M1)
    return values, scales, tensor_scale
