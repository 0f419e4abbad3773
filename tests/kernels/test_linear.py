"""Block-quantized GEMM and clamped SwiGLU (kernels/linear.py), through torch.ops.deepinfer."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepinfer.kernels  # noqa: F401  (registers the ops)

OPS = torch.ops.deepinfer
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _fp8_codes(gen, shape) -> torch.Tensor:
    c = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    return torch.where((c & 127) == 127, c - 1, c).to(torch.uint8)  # no NaN codes


def _scale_bytes(gen, shape, lo=118, hi=128) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


def _weight_fp8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K] e4m3fn codes times the 2^(s-127) of their 32x32 block, in float64."""
    n, k = codes.shape
    w = codes.view(torch.float8_e4m3fn).double()
    for r in range(n):
        for c in range(0, k, 32):
            w[r, c : c + 32] *= math.ldexp(1.0, int(scales[r // 32, c // 32]) - 127)
    return w


def _weight_fp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K/2] packed e2m1 (low nibble = even column) times 2^(s-127) per row and 32 columns."""
    n, half = packed.shape
    w = torch.empty(n, 2 * half, dtype=torch.float64)
    for r in range(n):
        for c in range(2 * half):
            byte = int(packed[r, c // 2])
            code = (byte >> 4) if c % 2 else (byte & 15)
            w[r, c] = E2M1_TABLE[code] * math.ldexp(1.0, int(scales[r, c // 32]) - 127)
    return w


# ---------------------------------------------------------------- blockquant_gemm


@pytest.mark.parametrize("n, k", [(40, 70), (32, 64), (5, 13)])
def test_blockquant_gemm_fp8_shared_weight(n, k):
    gen = torch.Generator().manual_seed(n * 100 + k)
    codes = _fp8_codes(gen, (n, k))
    scales = _scale_bytes(gen, (math.ceil(n / 32), math.ceil(k / 32)))
    x = torch.randn(3, 5, k, generator=gen)
    got = OPS.blockquant_gemm(x, codes, scales, "fp8")
    assert got.shape == (3, 5, n) and got.dtype == torch.float32
    want = x.double() @ _weight_fp8(codes, scales).T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("n, k", [(40, 70), (8, 64), (3, 2)])
def test_blockquant_gemm_fp4_shared_weight(n, k):
    gen = torch.Generator().manual_seed(n * 100 + k + 1)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = _scale_bytes(gen, (n, math.ceil(k / 32)))
    x = torch.randn(4, k, generator=gen)
    got = OPS.blockquant_gemm(x, packed, scales, "fp4")
    assert got.shape == (4, n) and got.dtype == torch.float32
    want = x.double() @ _weight_fp4(packed, scales).T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_blockquant_gemm_bf16_activations():
    gen = torch.Generator().manual_seed(2)
    codes = _fp8_codes(gen, (40, 70))
    scales = _scale_bytes(gen, (2, 3))
    x = torch.randn(6, 70, generator=gen).to(torch.bfloat16)
    got = OPS.blockquant_gemm(x, codes, scales, "fp8")
    assert got.dtype == torch.bfloat16 and got.shape == (6, 40)
    want = x.double() @ _weight_fp8(codes, scales).T
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("n, k", [(40, 70), (64, 32)])
def test_blockquant_gemm_fp8_per_row_weights(n, k):
    # MoE form: x [T, k, K] with one weight per (token, slot): codes [T, k, N, K]
    gen = torch.Generator().manual_seed(3)
    t, slots = 4, 3
    codes = _fp8_codes(gen, (t, slots, n, k))
    scales = _scale_bytes(gen, (t, slots, math.ceil(n / 32), math.ceil(k / 32)))
    x = torch.randn(t, slots, k, generator=gen)
    got = OPS.blockquant_gemm(x, codes, scales, "fp8")
    assert got.shape == (t, slots, n)
    for i in range(t):
        for j in range(slots):
            want = _weight_fp8(codes[i, j], scales[i, j]) @ x[i, j].double()
            torch.testing.assert_close(got[i, j].double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_blockquant_gemm_fp4_per_row_weights():
    gen = torch.Generator().manual_seed(4)
    t, slots, n, k = 3, 2, 16, 96
    packed = torch.randint(0, 256, (t, slots, n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = _scale_bytes(gen, (t, slots, n, 3))
    x = torch.randn(t, slots, k, generator=gen)
    got = OPS.blockquant_gemm(x, packed, scales, "fp4")
    assert got.shape == (t, slots, n)
    for i in range(t):
        for j in range(slots):
            want = _weight_fp4(packed[i, j], scales[i, j]) @ x[i, j].double()
            torch.testing.assert_close(got[i, j].double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@settings(max_examples=15, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    n=st.integers(1, 40),
    k=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_blockquant_gemm_fp8_property_shapes(lead, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = _fp8_codes(gen, (n, k))
    scales = _scale_bytes(gen, (math.ceil(n / 32), math.ceil(k / 32)))
    x = torch.randn(*lead, k, generator=gen)
    got = OPS.blockquant_gemm(x, codes, scales, "fp8")
    assert got.shape == (*lead, n)
    want = x.double() @ _weight_fp8(codes, scales).T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * (want.abs().max().item() + 1))


# ---------------------------------------------------------------- swiglu


def _swiglu_formula(gate, up, weight, limit):
    g, u = gate.double(), up.double()
    if limit > 0:
        g = torch.minimum(g, torch.tensor(float(limit), dtype=torch.float64))
        u = torch.maximum(
            torch.minimum(u, torch.tensor(float(limit), dtype=torch.float64)),
            torch.tensor(-float(limit), dtype=torch.float64),
        )
    y = g / (1 + torch.exp(-g)) * u
    return y if weight is None else y * weight.double()


@pytest.mark.parametrize("limit", [10.0, 3.0, 0.0, -1.0])
@pytest.mark.parametrize("with_weight", [False, True])
def test_swiglu_matches_formula(limit, with_weight):
    gen = torch.Generator().manual_seed(int(limit) + 20)
    gate = torch.randn(3, 5, 64, generator=gen) * 8
    up = torch.randn(3, 5, 64, generator=gen) * 8
    weight = torch.rand(3, 5, 1, generator=gen) if with_weight else None
    got = OPS.swiglu(gate, up, weight, limit)
    assert got.dtype == torch.float32 and got.shape == gate.shape
    torch.testing.assert_close(got.double(), _swiglu_formula(gate, up, weight, limit), rtol=1e-5, atol=1e-6)


def test_swiglu_clamps_gate_above_only_and_up_both_sides():
    gate = torch.tensor([-15.0, 15.0, 1.0, 1.0, 12.0])
    up = torch.tensor([1.0, 1.0, 15.0, -15.0, -12.0])
    got = OPS.swiglu(gate, up, None, 10.0)
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    want = [silu(-15.0) * 1, silu(10.0) * 1, silu(1.0) * 10, silu(1.0) * -10, silu(10.0) * -10]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("limit", [0.0, -5.0])
def test_swiglu_non_positive_limit_disables_clamps(limit):
    got = OPS.swiglu(torch.tensor([50.0, -30.0]), torch.tensor([-40.0, 2.0]), None, limit)
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    torch.testing.assert_close(
        got.double(), torch.tensor([silu(50.0) * -40, silu(-30.0) * 2], dtype=torch.float64), rtol=1e-6, atol=1e-12
    )


def test_swiglu_weight_broadcasts_per_row():
    gate = torch.full((2, 3, 4), 2.0)
    up = torch.ones(2, 3, 4)
    weight = torch.tensor([0.5, 2.0, 0.0]).view(1, 3, 1)
    got = OPS.swiglu(gate, up, weight, 10.0)
    silu2 = 2.0 / (1 + math.exp(-2.0))
    for j, w in enumerate([0.5, 2.0, 0.0]):
        torch.testing.assert_close(got[:, j], torch.full((2, 4), silu2 * w), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "gate_dtype, up_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
)
def test_swiglu_output_dtype_is_gates(gate_dtype, up_dtype):
    gen = torch.Generator().manual_seed(5)
    gate = (torch.randn(4, 32, generator=gen) * 4).to(gate_dtype)
    up = (torch.randn(4, 32, generator=gen) * 4).to(up_dtype)
    weight = torch.rand(4, 1, generator=gen)
    got = OPS.swiglu(gate, up, weight, 10.0)
    assert got.dtype == gate_dtype
    want = _swiglu_formula(gate, up, weight, 10.0)
    if gate_dtype == torch.bfloat16:
        # float32 math, one rounding at the end: within one bf16 rounding of the exact value
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-6)
    else:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- moe_experts


def _experts_formula(x, weights, w1, w1_s, w3, w3_s, w2, w2_s, limit):
    """Expert by expert in float64: sum_e w2_e(swiglu(w1_e x, w3_e x) * weights[:, e])."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in range(w1.shape[0]):
        g = x.double() @ _weight_fp4(w1[e], w1_s[e]).T
        u = x.double() @ _weight_fp4(w3[e], w3_s[e]).T
        out += _swiglu_formula(g, u, weights[:, e : e + 1], limit) @ _weight_fp4(w2[e], w2_s[e]).T
    return out


def _expert_stacks(gen, experts, inter, hidden):
    def fp4(rows, cols):
        packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, dtype=torch.int32)
        return packed.to(torch.uint8), _scale_bytes(gen, (experts, rows, math.ceil(cols / 32)), 124, 128)

    return (*fp4(inter, hidden), *fp4(inter, hidden), *fp4(hidden, inter))


@pytest.mark.parametrize("tile_bytes", [1 << 30, 12_000])  # one tile; three, the last one shorter
def test_moe_experts_matches_expert_by_expert(tile_bytes, monkeypatch):
    """Rows routed to some experts only (zero weights elsewhere), a row routed nowhere, clamps active."""
    from deepinfer.kernels import linear

    monkeypatch.setattr(linear, "EXPERT_TILE_BYTES", tile_bytes)
    gen = torch.Generator().manual_seed(7)
    experts, inter, hidden, rows = 3, 40, 64, 5
    assert len(linear.expert_tiles(experts, inter, hidden)) == (1 if tile_bytes > 1e6 else 3)
    stacks = _expert_stacks(gen, experts, inter, hidden)
    x = torch.randn(rows, hidden, generator=gen)
    weights = torch.rand(rows, experts, generator=gen) * (torch.rand(rows, experts, generator=gen) < 0.6)
    weights[2] = 0.0
    got = OPS.moe_experts(x, weights, *stacks, 10.0)
    want = _experts_formula(x, weights, *stacks, 10.0)
    assert got.dtype == torch.float32 and got.shape == (rows, hidden)
    assert torch.equal(got[2], torch.zeros(hidden))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_moe_experts_bf16_casts_each_product_before_w2():
    """In bf16 the weighted SwiGLU product is rounded to bf16 before w2 (MODEL.md)."""
    gen = torch.Generator().manual_seed(8)
    stacks = _expert_stacks(gen, 2, 32, 64)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    weights = torch.rand(4, 2, generator=gen)
    got = OPS.moe_experts(x, weights, *stacks, 10.0)
    want = torch.zeros(4, 64, dtype=torch.float64)
    for e in range(2):
        g = x.double() @ _weight_fp4(stacks[0][e], stacks[1][e]).T
        u = x.double() @ _weight_fp4(stacks[2][e], stacks[3][e]).T
        a = _swiglu_formula(g, u, weights[:, e : e + 1], 10.0).to(torch.bfloat16).double()
        want += a @ _weight_fp4(stacks[4][e], stacks[5][e]).T
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize(
    "experts, rows, cols", [(6, 2304, 5120), (6, 5120, 2304), (384, 2304, 5120), (8, 64, 256), (1, 1, 32)]
)
def test_expert_tiles_cover_the_rows_in_bounded_tiles(experts, rows, cols):
    from deepinfer.kernels.linear import EXPERT_MAX_TILES, EXPERT_TILE_BYTES, expert_tiles

    tiles = expert_tiles(experts, rows, cols)
    assert tiles[0][0] == 0 and tiles[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
    assert all(stop > start for start, stop in tiles)
    assert len(tiles) <= EXPERT_MAX_TILES
    tile_bytes = experts * (tiles[0][1] - tiles[0][0]) * cols * 4
    assert tile_bytes <= EXPERT_TILE_BYTES or len(tiles) == EXPERT_MAX_TILES
    assert tile_bytes <= max(EXPERT_TILE_BYTES, -(-experts * rows * cols * 4 // EXPERT_MAX_TILES) + experts * cols * 4)


# ---------------------------------------------------------------- moe_gathered


def _slice_stacks(stacks, a: int, b: int):
    """Columns [a, b) of every expert's intermediate (regions/topology.expert_slice): w1, w3 rows, w2 byte
    columns and the 32-blocks of its scales they span; with the column -> block map."""
    w1, w1_s, w3, w3_s, w2, w2_s = stacks
    blocks = (a % 32 + torch.arange(b - a)) // 32
    cut = (
        w1[:, a:b],
        w1_s[:, a:b],
        w3[:, a:b],
        w3_s[:, a:b],
        w2[:, :, a // 2 : b // 2],
        w2_s[:, :, a // 32 : -(-b // 32)],
    )
    return cut, blocks


def _routing_loop(x, weights, experts, whole, a, b):
    """Each row's k choices in float64, columns [a, b) of every expert's intermediate."""
    rows, k = experts.shape
    want = torch.zeros(rows, x.shape[-1], dtype=torch.float64)
    for n in range(rows):
        for j in range(k):
            e = int(experts[n, j])
            g = x[n].double() @ _weight_fp4(whole[0][e], whole[1][e])[a:b].T
            u = x[n].double() @ _weight_fp4(whole[2][e], whole[3][e])[a:b].T
            want[n] += _swiglu_formula(g, u, weights[n, j], 10.0) @ _weight_fp4(whole[4][e], whole[5][e])[:, a:b].T
    return want


@pytest.mark.parametrize("partial", [False, True], ids=["per-expert", "partial"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("piece", [None, (20, 44), (40, 64)], ids=["whole", "straddling", "aligned-end"])
def test_moe_gathered_equals_grouped_and_the_expert_loop(rows, piece, partial):
    """Each row's k chosen experts gathered (`moe_gathered`) give what every expert over dense routing
    weights gives (`moe_experts`) and a plain loop over rows and choices in float64; on a column slice
    of the experts whose w2 scale blocks straddle (column j takes block blocks[j]) as on whole experts.
    Repeated choices of one expert across rows, clamps active; w2 per expert or over all (`partial`)."""
    gen = torch.Generator().manual_seed(11)
    E, inter, hidden, k = 5, 64, 64, 2
    whole = _expert_stacks(gen, E, inter, hidden)
    stacks, blocks = _slice_stacks(whole, *piece) if piece else (whole, None)
    a, b = piece or (0, inter)
    x = torch.randn(rows, hidden, generator=gen)
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, generator=gen)
    got = OPS.moe_gathered(x, weights, experts, *stacks, 10.0, blocks, partial)
    dense = torch.zeros(rows, E).scatter(1, experts, weights)
    grouped = OPS.moe_experts(x, dense, *stacks, 10.0, blocks, partial)
    want = _routing_loop(x, weights, experts, whole, a, b)
    assert got.dtype == torch.float32 and got.shape == (rows, hidden)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(got, grouped, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("partial", [False, True], ids=["per-expert", "partial"])
def test_moe_gathered_bf16_matches_grouped(partial):
    """In bf16 both forms round the weighted product alike, and each expert's output (or, `partial`,
    none: w2 over all the slices in float32, within float32 rounding of each other)."""
    gen = torch.Generator().manual_seed(12)
    stacks = _expert_stacks(gen, 4, 64, 64)
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    experts, weights = torch.tensor([[3, 1], [1, 0]]), torch.rand(2, 2, generator=gen)
    got = OPS.moe_gathered(x, weights, experts, *stacks, 10.0, None, partial)
    want = OPS.moe_experts(x, torch.zeros(2, 4).scatter(1, experts, weights), *stacks, 10.0, None, partial)
    tol = 1e-5 if partial else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


# ---------------------------------------------------------------- moe_tiled


def _worst_routings(gen, rows: int, E: int, k: int) -> dict[str, torch.Tensor]:
    """experts [rows, k] (distinct per row): random; uniform (each expert as often); every expert one
    assignment and one expert the rest (the tile bound's worst case); all on the same k experts."""
    shifted = (torch.arange(rows).unsqueeze(-1) * k + torch.arange(k)) % E
    few = torch.arange(k).expand(rows, k)
    worst = torch.stack([torch.tensor([0, 1 + n]) if n + 1 < E else torch.tensor([0, 1]) for n in range(rows)])
    random = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(rows)])
    return {"random": random, "uniform": shifted, "worst": worst, "same": few}


@pytest.mark.parametrize("partial", [False, True], ids=["per-expert", "partial"])
@pytest.mark.parametrize("tile", [1, 2, 4, 16])
@pytest.mark.parametrize("piece", [None, (20, 44)], ids=["whole", "straddling"])
def test_moe_tiled_equals_gathered_grouped_and_the_expert_loop(tile, piece, partial):
    """The assignments grouped by expert in tiles (`moe_tiled`) give what `moe_gathered`, `moe_experts`
    over dense weights and a float64 loop over rows and choices give, at every routing the tile bound
    must cover (a tile of 1 row to one wider than any expert's count; whole experts and a column slice
    whose w2 scale blocks straddle; w2 per expert or over all, `partial`)."""
    gen = torch.Generator().manual_seed(21)
    E, inter, hidden, k, rows = 6, 64, 64, 2, 9
    whole = _expert_stacks(gen, E, inter, hidden)
    stacks, blocks = _slice_stacks(whole, *piece) if piece else (whole, None)
    a, b = piece or (0, inter)
    x = torch.randn(rows, hidden, generator=gen)
    weights = torch.rand(rows, k, generator=gen)
    for name, experts in _worst_routings(gen, rows, E, k).items():
        got = OPS.moe_tiled(x, weights, experts, *stacks, 10.0, tile, blocks, partial)
        gathered = OPS.moe_gathered(x, weights, experts, *stacks, 10.0, blocks, partial)
        dense = torch.zeros(rows, E).scatter(1, experts, weights)
        grouped = OPS.moe_experts(x, dense, *stacks, 10.0, blocks, partial)
        want = _routing_loop(x, weights, experts, whole, a, b)
        tol = 1e-5 * want.abs().max().item()
        assert got.dtype == torch.float32 and got.shape == (rows, hidden), name
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=tol, msg=name)
        torch.testing.assert_close(got, gathered, rtol=1e-6, atol=1e-6 * want.abs().max().item(), msg=name)
        torch.testing.assert_close(got, grouped, rtol=1e-5, atol=tol, msg=name)


@pytest.mark.parametrize("partial", [False, True], ids=["per-expert", "partial"])
def test_moe_tiled_bf16_matches_gathered_and_grouped(partial):
    """In bf16 the tiled form rounds as the gathered one does: the weighted product before w2, each
    expert's output (`partial`: w2 over the slices in float32), so it matches both within the
    tolerances the gathered form meets against the grouped one."""
    gen = torch.Generator().manual_seed(22)
    stacks = _expert_stacks(gen, 4, 64, 64)
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    experts = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=gen)
    got = OPS.moe_tiled(x, weights, experts, *stacks, 10.0, 4, None, partial)
    gathered = OPS.moe_gathered(x, weights, experts, *stacks, 10.0, None, partial)
    grouped = OPS.moe_experts(x, torch.zeros(7, 4).scatter(1, experts, weights), *stacks, 10.0, None, partial)
    torch.testing.assert_close(got, gathered, rtol=1e-5, atol=1e-5 * gathered.abs().max().item())
    tol = 1e-5 if partial else 2e-2
    torch.testing.assert_close(got, grouped, rtol=tol, atol=tol * grouped.abs().max().item())


@pytest.mark.parametrize("experts, k", [(384, 6), (8, 2), (5, 2)])
@pytest.mark.parametrize("rows", [1, 3, 64, 200])
@pytest.mark.parametrize("tile", [1, 3, 8, 32, 128])
def test_tiles_bound_is_the_worst_routing_exactly(experts, k, rows, tile):
    """`tiles_bound` is met by the worst routing (every expert but one a single assignment, the last
    the rest) and never passed: uniform, one expert all of them, random counts."""
    from deepinfer.kernels.linear import tiles_bound

    A = rows * k
    bound = tiles_bound(A, experts, tile)

    def tiles(counts) -> int:
        assert sum(counts) == A and len(counts) <= experts
        return sum(-(-c // tile) for c in counts)

    n = min(experts, A)
    assert tiles([1] * (n - 1) + [A - n + 1]) == bound
    assert tiles([A]) <= bound and tiles([A // n + (i < A % n) for i in range(n)]) <= bound
    gen = torch.Generator().manual_seed(rows * tile)
    for _ in range(20):
        counts = torch.zeros(experts, dtype=torch.long).scatter_add(
            0, torch.randint(0, experts, (A,), generator=gen), torch.ones(A, dtype=torch.long)
        )
        assert tiles(counts.tolist()) <= bound
    assert -(-A // tile) <= bound <= A


def test_moe_tiled_worst_routing_fills_every_tile():
    """At the bound's worst routing every one of the static tiles holds an assignment: none to spare,
    and the result still equals the gathered form's."""
    from deepinfer.kernels.linear import _tile_slots, tiles_bound

    E, k, rows, tile = 6, 2, 9, 2
    experts = _worst_routings(torch.Generator().manual_seed(0), rows, E, k)["worst"]
    slot, tile_expert = _tile_slots(experts, E, tile)
    assert tile_expert.shape == (tiles_bound(rows * k, E, tile),)
    assert sorted(set((slot // tile).tolist())) == list(range(tile_expert.shape[0]))
    assert len(set(slot.tolist())) == rows * k
    assert torch.equal(tile_expert[slot // tile], experts.reshape(-1))


@pytest.mark.parametrize("A, E", [(1, 1), (5, 3), (128, 4), (300, 7), (1000, 384)])
def test_expert_places_count_the_earlier_equal_ids(A, E):
    """Each assignment's place among its expert's (no sort, no scan over the assignments: blocks of
    `RANK_BLOCK`, padded) is the number of earlier equal ids, and the counts are each expert's."""
    from deepinfer.kernels.linear import _expert_places

    ids = torch.randint(0, E, (A,), generator=torch.Generator().manual_seed(A))
    place, counts = _expert_places(ids, E)
    want = [int((ids[:a] == ids[a]).sum()) for a in range(A)]
    assert place.tolist() == want
    assert torch.equal(counts, torch.bincount(ids, minlength=E))


def test_moe_tiled_over_several_place_blocks():
    """300 rows x top-2 (5 blocks of `RANK_BLOCK` assignments, the last padded), skewed routing: the
    tiled form gives the gathered form's result."""
    gen = torch.Generator().manual_seed(23)
    E, rows = 6, 300
    stacks = _expert_stacks(gen, E, 32, 64)
    x = torch.randn(rows, 64, generator=gen)
    first = torch.where(torch.rand(rows, generator=gen) < 0.7, 0, torch.randint(1, E, (rows,), generator=gen))
    experts = torch.stack([first, (first + 1 + torch.randint(0, E - 1, (rows,), generator=gen)) % E], -1)
    weights = torch.rand(rows, 2, generator=gen)
    for partial in (False, True):
        got = OPS.moe_tiled(x, weights, experts, *stacks, 10.0, 16, None, partial)
        want = OPS.moe_gathered(x, weights, experts, *stacks, 10.0, None, partial)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
