"""The op list of trn2's rows module run as two micro-batches (compiler/rows_layers.micro), on a made-up
pass: what is split, suffixed, shared, interleaved and joined. The modules themselves, lowered and run
against the cpu runtime's micro-batches, are tests/trn2/test_rows_layers.py's."""

from __future__ import annotations

import torch

from deepinfer.compiler.layers import Glue, Run
from deepinfer.compiler.prompt_rows import fused_passes
from deepinfer.compiler.rows_layers import micro
from deepinfer.compiler.targets.hlo import Collective
from deepinfer.regions.state import InputSpec

GROUP = ((0, 1),)


def _spec(name: str, shape: tuple[int, ...], role: str = "activation") -> InputSpec:
    return InputSpec(name, shape, torch.float32, role)


def test_two_passes_split_the_rows_share_the_rest_and_interleave_between_collectives():
    """A pass of: stage a (the rank's rows h and the chunk's positions, the sequences' slots, a state
    ring) -> all-gather -> stage b (a kv source's pages out) -> reduce-scatter. The inputs that differ
    at half the chunk are split in two; the state and the slots keep their names in both passes, so the
    second pass's stage a reads the ring the first one's wrote; each pass's values carry its suffix;
    the passes alternate between collectives; the rows' output is joined, the pages are the last pass's."""
    one = [
        Run("s", "a", (("h", "h"), ("positions", "positions"), ("slots", "slots"), ("ring", "ring")), (("y", "y"),)),
        Collective("all_gather", "y", "y_all", GROUP, dim=1),
        Run("s", "b", (("y_all", "y_all"), ("ring", "ring")), (("h", "h"), ("ckv_pages", "ckv_pages"))),
        Collective("reduce_scatter", "h", "h", GROUP, dim=1),
    ]
    full = {
        "h": _spec("h", (1, 4, 8)),
        "positions": _spec("positions", (1, 8), "step"),
        "slots": _spec("slots", (1,), "step"),
        "ring": _spec("ring", (2, 3), "state"),
    }
    part = {**full, "h": _spec("h", (1, 2, 8)), "positions": _spec("positions", (1, 4), "step")}
    ops = micro(one, 2, full, part, ["h", "ckv_pages"])
    splits = [op for op in ops if isinstance(op, Glue) and op.fn == "split_rows"]
    assert [(g.args, g.results, g.kwargs) for g in splits] == [
        (("h",), ("h.0", "h.1"), (("parts", 2),)),
        (("positions",), ("positions.0", "positions.1"), (("parts", 2),)),
    ]
    assert len({g.piece for g in splits}) == 2  # one module function a shape
    body = [op for op in ops if not isinstance(op, Glue)]
    runs = [(op.method, dict(op.inputs), dict(op.outputs)) for op in body if isinstance(op, Run)]
    assert [(m, i["h" if m == "a" else "y_all"]) for m, i, _ in runs] == [
        ("a", "h.0"),
        ("a", "h.1"),
        ("b", "y_all.0"),
        ("b", "y_all.1"),
    ]
    assert all(i["ring"] == "ring" for _, i, _ in runs) and all(i["slots"] == "slots" for m, i, _ in runs if m == "a")
    assert [o["ckv_pages"] for m, _, o in runs if m == "b"] == ["ckv_pages.0", "ckv_pages"]
    kinds = [f"{type(op).__name__} {getattr(op, 'method', getattr(op, 'src', ''))}" for op in body]
    assert kinds == [
        "Run a",
        "Collective y.0",
        "Run a",
        "Collective y.1",
        "Run b",
        "Collective h.0",
        "Run b",
        "Collective h.1",
    ]
    (join,) = [op for op in ops if isinstance(op, Glue) and op.fn == "join_rows"]
    assert (join.args, join.results) == (("h.0", "h.1"), ("h",)) and ops[-1] is join


def test_a_chunk_runs_as_two_micro_batches_where_each_has_whole_rows_a_rank():
    assert fused_passes(8192, 64) == 2 and fused_passes(4096, 64) == 2
    assert fused_passes(64, 64) == 1 and fused_passes(192, 64) == 1 and fused_passes(8, 4) == 2
