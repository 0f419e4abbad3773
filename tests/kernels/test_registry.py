"""The kernel registry: ops, fake implementations, export as single nodes, decompositions."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from deepinfer.kernels import KERNELS, reference_decompositions

EXPECTED = {
    "blockquant_gemm",
    "swiglu",
    "moe_experts",
    "moe_gathered",
    "moe_tiled",
    "rmsnorm",
    "hc_mixes",
    "hc_collapse",
    "hc_expand",
    "sparse_attn",
    "index_score",
    "compress_pool",
    "top_indices",
    "index_topk",
}
u8, f32, bf16, b8 = torch.uint8, torch.float32, torch.bfloat16, torch.bool


def _t(shape, dtype):
    if dtype == torch.uint8:
        return torch.randint(0, 120, shape, dtype=torch.int32).to(torch.uint8)
    if dtype == torch.bool:
        return torch.rand(shape) < 0.5
    return torch.randn(shape).to(dtype)


def _stacks(width: int, blocks: int) -> tuple[torch.Tensor, ...]:
    """Three experts' routed stacks (w1, w1_s, w3, w3_s, w2, w2_s) of `width` intermediate columns, hidden
    64, w2's scales `blocks` 32-blocks."""
    up = (_t((3, width, 32), u8), _t((3, width, 2), u8))
    return (*up, _t((3, width, 32), u8), _t((3, width, 2), u8), _t((3, 64, width // 2), u8), _t((3, 64, blocks), u8))


# name -> list of (args, [(shape, dtype) of each output])
CASES = {
    "blockquant_gemm": [
        ((_t((3, 5, 70), bf16), _t((40, 70), u8), _t((2, 3), u8), "fp8"), [((3, 5, 40), bf16)]),
        ((_t((4, 64), f32), _t((40, 32), u8), _t((40, 2), u8), "fp4"), [((4, 40), f32)]),
        ((_t((4, 3, 64), f32), _t((4, 3, 40, 64), u8), _t((4, 3, 2, 2), u8), "fp8"), [((4, 3, 40), f32)]),
        ((_t((4, 3, 64), bf16), _t((4, 3, 40, 32), u8), _t((4, 3, 40, 2), u8), "fp4"), [((4, 3, 40), bf16)]),
    ],
    "swiglu": [
        ((_t((2, 3, 64), bf16), _t((2, 3, 64), bf16), _t((2, 3, 1), f32), 10.0), [((2, 3, 64), bf16)]),
        ((_t((5, 8), f32), _t((5, 8), bf16), None, 0.0), [((5, 8), f32)]),
    ],
    "moe_experts": [
        (
            (
                _t((5, 64), bf16),
                _t((5, 3), f32),
                _t((3, 32, 32), u8),
                _t((3, 32, 2), u8),
                _t((3, 32, 32), u8),
                _t((3, 32, 2), u8),
                _t((3, 64, 16), u8),
                _t((3, 64, 1), u8),
                10.0,
            ),
            [((5, 64), f32)],
        ),
        (  # slices of 24 columns whose w2 scales span 2 blocks
            (
                _t((5, 64), bf16),
                _t((5, 3), f32),
                _t((3, 24, 32), u8),
                _t((3, 24, 2), u8),
                _t((3, 24, 32), u8),
                _t((3, 24, 2), u8),
                _t((3, 64, 12), u8),
                _t((3, 64, 2), u8),
                10.0,
                torch.tensor([0] * 8 + [1] * 16),
                True,
            ),
            [((5, 64), f32)],
        ),
    ],
    "moe_gathered": [
        (
            (
                _t((5, 64), bf16),
                _t((5, 2), f32),
                torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0], [0, 1]]),
                _t((3, 32, 32), u8),
                _t((3, 32, 2), u8),
                _t((3, 32, 32), u8),
                _t((3, 32, 2), u8),
                _t((3, 64, 16), u8),
                _t((3, 64, 1), u8),
                10.0,
            ),
            [((5, 64), f32)],
        ),
        (
            (
                _t((1, 64), f32),
                _t((1, 2), f32),
                torch.tensor([[2, 1]]),
                _t((3, 24, 32), u8),
                _t((3, 24, 2), u8),
                _t((3, 24, 32), u8),
                _t((3, 24, 2), u8),
                _t((3, 64, 12), u8),
                _t((3, 64, 2), u8),
                10.0,
                torch.tensor([0] * 8 + [1] * 16),
                True,
            ),
            [((1, 64), f32)],
        ),
    ],
    "moe_tiled": [
        (
            (
                _t((5, 64), bf16),
                _t((5, 2), f32),
                torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0], [0, 1]]),
                *_stacks(32, 1),
                10.0,
                4,
            ),
            [((5, 64), f32)],
        ),
        (  # tiles of 2 rows over slices of 24 columns whose w2 scales span 2 blocks, w2 over all of them
            (
                _t((3, 64), f32),
                _t((3, 2), f32),
                torch.tensor([[2, 1], [1, 0], [1, 2]]),
                *_stacks(24, 2),
                10.0,
                2,
                torch.tensor([0] * 8 + [1] * 16),
                True,
            ),
            [((3, 64), f32)],
        ),
    ],
    "rmsnorm": [
        ((_t((2, 3, 32), bf16), _t((32,), bf16), 1e-20), [((2, 3, 32), bf16)]),
        ((_t((7, 16), f32), _t((16,), f32), 1e-6), [((7, 16), f32)]),
    ],
    "hc_mixes": [
        (
            (_t((2, 3, 4, 8), bf16), _t((24, 32), f32), _t((24,), f32), _t((3,), f32), 1e-20, 1e-6, 20),
            [((2, 3, 4), f32), ((2, 3, 4), f32), ((2, 3, 4, 4), f32)],
        ),
    ],
    "hc_collapse": [((_t((2, 3, 4, 8), bf16), _t((2, 3, 4), f32)), [((2, 3, 8), bf16)])],
    "hc_expand": [
        (
            (_t((2, 3, 8), bf16), _t((2, 3, 4, 8), bf16), _t((2, 3, 4), f32), _t((2, 3, 4, 4), f32)),
            [((2, 3, 4, 8), bf16)],
        ),
    ],
    "sparse_attn": [
        (
            (_t((2, 3, 4, 16), bf16), _t((2, 3, 10, 16), bf16), _t((2, 3, 10), b8), _t((4,), f32), 0.25),
            [((2, 3, 4, 16), bf16)],
        ),
    ],
    "sparse_attn_partial": [
        (
            (
                _t((2, 3, 4, 16), bf16),
                _t((2, 3, 10, 16), bf16),
                _t((2, 3, 10), b8),
                _t((4,), f32),
                0.25,
                torch.tensor(True),
            ),
            [((2, 3, 4, 16), f32), ((2, 3, 4), f32), ((2, 3, 4), f32)],
        ),
    ],
    "index_score": [
        ((_t((2, 3, 4, 16), f32), _t((2, 7, 16), f32), _t((2, 3, 4), f32), _t((2, 3, 7), b8)), [((2, 3, 7), f32)]),
    ],
    "compress_pool": [((_t((2, 3, 4, 16), bf16), _t((2, 3, 4, 16), bf16)), [((2, 3, 16), f32)])],
    "top_indices": [((_t((2, 3, 37), f32), 5), [((2, 3, 5), torch.int64)])],
    "index_topk": [
        (
            (_t((2, 3, 4, 16), f32), _t((2, 40, 16), f32), _t((2, 3, 4), f32), torch.randint(0, 40, (2, 3)), None)
            + (5, 3, 4, True),
            [((2, 3, 5), torch.int64), ((2, 3, 40), b8)],
        ),
        (
            (_t((2, 3, 4, 16), bf16), _t((2, 40, 16), bf16), _t((2, 3, 4), bf16), torch.randint(0, 40, (2, 3)))
            + (_t((2, 3, 40), b8), 5, 3, 4, False),
            [((2, 3, 5), torch.int64), ((0,), b8)],
        ),
    ],
}


def _outputs(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


def test_every_expected_kernel_is_registered():
    assert EXPECTED <= set(KERNELS)
    for name, kernel in KERNELS.items():
        assert kernel.name == name
        assert hasattr(torch.ops.deepinfer, name)
        overload = getattr(torch.ops.deepinfer, name).default
        assert isinstance(overload, torch._ops.OpOverload)
        assert overload.name() == f"deepinfer::{name}"
        assert kernel.source.is_file()
        assert f"def {name}_ref(" in kernel.source.read_text()


def test_overload_is_the_traced_op_and_stable():
    # OpOverload compares by identity: `Kernel.overload` must be the very object that a
    # trace records as a node target, every time it is read, or decomposition tables
    # keyed by it silently miss.
    for name, kernel in KERNELS.items():
        first = kernel.overload
        assert kernel.overload is first, name
        assert getattr(torch.ops.deepinfer, name).default is first, name


def test_every_kernel_has_a_fake_case():
    assert set(CASES) == set(KERNELS)


def test_eager_ops_give_expected_shapes():
    for name, cases in CASES.items():
        for args, outs in cases:
            got = _outputs(getattr(torch.ops.deepinfer, name)(*args))
            assert [(tuple(o.shape), o.dtype) for o in got] == outs, name


def test_fake_implementations_give_shapes_and_dtypes():
    for name, cases in CASES.items():
        for args, outs in cases:
            with FakeTensorMode() as mode:
                fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
                got = _outputs(getattr(torch.ops.deepinfer, name)(*fake_args))
            assert all(isinstance(o, FakeTensor) for o in got), name
            assert [(tuple(o.shape), o.dtype) for o in got] == outs, name


def test_fake_implementations_on_meta_device():
    for name, cases in CASES.items():
        args, outs = cases[0]
        meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        got = _outputs(getattr(torch.ops.deepinfer, name)(*meta))
        assert [(tuple(o.shape), o.dtype, o.device.type) for o in got] == [(s, d, "meta") for s, d in outs], name


def test_reference_decompositions_has_one_entry_per_kernel():
    table = reference_decompositions()
    assert len(table) == len(KERNELS)
    assert set(table) == {k.overload for k in KERNELS.values()}
    for kernel in KERNELS.values():
        assert table[kernel.overload] is kernel.reference


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x):
        return torch.ops.deepinfer.rmsnorm(x, self.weight, 1e-6)


class _Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("codes", torch.randint(0, 120, (48, 32), generator=g, dtype=torch.int32).to(u8))
        self.register_buffer("scales", torch.full((2, 1), 124, dtype=u8))
        self.weight = torch.nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x):
        y = torch.ops.deepinfer.rmsnorm(x, self.weight, 1e-6)
        gu = torch.ops.deepinfer.blockquant_gemm(y, self.codes, self.scales, "fp8")
        return torch.ops.deepinfer.swiglu(gu[..., :24], gu[..., 24:], None, 10.0)


def _count(graph_module, target) -> int:
    return sum(1 for n in graph_module.graph.nodes if n.op == "call_function" and n.target == target)


def _custom_nodes(graph_module):
    return [
        n
        for n in graph_module.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "deepinfer"
    ]


def test_export_keeps_rmsnorm_as_one_node_and_decomposes():
    x = torch.randn(2, 5, 32)
    module = _Norm()
    ep = torch.export.export(module, (x,))
    assert _count(ep.graph_module, torch.ops.deepinfer.rmsnorm.default) == 1
    assert len(_custom_nodes(ep.graph_module)) == 1
    assert _custom_nodes(ep.graph_module)[0].target in reference_decompositions()
    decomposed = ep.run_decompositions(reference_decompositions())
    assert _custom_nodes(decomposed.graph_module) == []
    want = module(x)
    torch.testing.assert_close(decomposed.module()(x), want, rtol=1e-6, atol=1e-6)
    x2 = torch.randn(2, 5, 32)
    torch.testing.assert_close(decomposed.module()(x2), module(x2), rtol=1e-6, atol=1e-6)


def test_export_of_several_kernels_decomposes_all():
    x = torch.randn(3, 32)
    module = _Expert()
    ep = torch.export.export(module, (x,))
    targets = [n.target for n in _custom_nodes(ep.graph_module)]
    assert sorted(str(t) for t in targets) == [
        "deepinfer.blockquant_gemm.default",
        "deepinfer.rmsnorm.default",
        "deepinfer.swiglu.default",
    ]
    decomposed = ep.run_decompositions(reference_decompositions())
    assert _custom_nodes(decomposed.graph_module) == []
    torch.testing.assert_close(decomposed.module()(x), module(x), rtol=1e-6, atol=1e-6)
