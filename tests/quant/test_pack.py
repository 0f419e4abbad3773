"""Packed ue8m0 scale layouts: byte positions as documented, round trips."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis.extra import numpy as hnp

from deepinfer.quant.errors import QuantInputError
from deepinfer.quant.pack import (
    LAYOUT_I16_PAIRS,
    LAYOUT_I32_MN_MAJOR,
    LAYOUT_U8,
    SCALE_LAYOUTS,
    expand_rows,
    pack_i16_pairs,
    pack_i32_mn_major,
    pack_scales,
    unpack_i16_pairs,
    unpack_i32_mn_major,
)


def test_i32_bytes_by_position():
    s = np.arange(1, 1 + 5 * 6, dtype=np.uint8).reshape(5, 6)  # MN 5, KB 6
    w = pack_i32_mn_major(s)
    assert w.shape == (2, 8) and w.dtype == np.int32
    raw = w.tobytes()  # memory order, little-endian
    for m in range(8):
        for k in range(8):
            byte = raw[4 * ((k // 4) * 8 + m) + k % 4]
            assert byte == (s[m, k] if m < 5 and k < 6 else 0), (m, k)
    assert w[0, 1] == int.from_bytes(bytes(s[1, :4]), "little", signed=True)


def test_i32_sign_bit_and_batch():
    s = np.full((3, 4, 8), 255, np.uint8)  # [experts, MN, KB]
    w = pack_i32_mn_major(s)
    assert w.shape == (3, 2, 4) and (w == -1).all()


def test_i16_matches_little_endian_view_and_torch_float_formula():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 256, size=(7, 10), dtype=np.uint8)
    h = pack_i16_pairs(s)
    assert np.array_equal(h, s.view("<i2").astype(np.int16))
    t = torch.from_numpy(s).float()  # the device's fp32 formulation
    ref = (t[:, 0::2] + 256 * t[:, 1::2] - 65536 * (t[:, 1::2] >= 128).float()).to(torch.int16)
    assert np.array_equal(h, ref.numpy())


def test_i16_odd_kb_pads_high_byte():
    s = np.array([[1, 2, 200]], np.uint8)
    assert pack_i16_pairs(s).tolist() == [[1 + 512, 200]]


@given(s=hnp.arrays(np.uint8, hnp.array_shapes(min_dims=2, max_dims=4, min_side=1, max_side=17)))
@settings(max_examples=80, deadline=None)
def test_round_trips(s):
    mn, kb = s.shape[-2:]
    assert np.array_equal(unpack_i32_mn_major(pack_i32_mn_major(s), mn, kb), s)
    assert np.array_equal(unpack_i16_pairs(pack_i16_pairs(s), kb), s)
    assert np.array_equal(pack_scales(s, LAYOUT_U8), s)


def test_expand_rows_and_errors():
    s = np.array([[1, 2], [3, 4]], np.uint8)
    assert expand_rows(s, 128, 130).shape == (130, 2)
    assert expand_rows(s, 128, 130)[129].tolist() == [3, 4]
    with pytest.raises(QuantInputError, match="unknown scale layout"):
        pack_scales(s, "int32")
    with pytest.raises(QuantInputError, match="uint8"):
        pack_i16_pairs(s.astype(np.int16))
    assert set(SCALE_LAYOUTS) == {LAYOUT_U8, LAYOUT_I32_MN_MAJOR, LAYOUT_I16_PAIRS}
