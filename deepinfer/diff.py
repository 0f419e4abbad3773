"""Which region kind of a bundle disagrees with its pure-torch reference, and by how much.

`diff_bundle` runs a bundle on prompts (greedy, as `deepinfer-run` does) with
a hook around every region call (`on_call`, an argument of the run). For each call it copies
the inputs before the executable runs (state views included: an executable
writes its state in place), runs the executable, then runs the eager
reference region of that kind on the copies: the region built from the
bundle's own config, with that layer's weights bound from the bundle's own
weight stacks (the manifest's layer binding names the stack row). It compares
every output and every state the call wrote.

The run itself goes on with the executable's outputs, so each call is judged
on exactly the inputs the executable saw: differences do not compound from
layer to layer, and the worst kind is the one whose own graph disagrees.

Scores, per output (regions/agreement.py, the rule the compile-time check of
lowered graphs uses too): floating point -> max |exe - ref| / max |ref|;
integer (top-k indices, candidates) -> the fraction of entries that differ. A
call's score is its worst output's; a kind's (or a layer's) is its worst call's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.bundles.manifest import BundleError
from deepinfer.regions.agreement import TOLERANCE, OutputDiff, ShapeMismatch, compare_tensors


@dataclass
class Entry:
    """The worst difference of one (kind, layer), or of a kind over its layers."""

    kind: str
    layer: int  # the layer (for a kind: its worst layer); -1 is the model's ends (embed, head)
    calls: int = 0
    score: float = 0.0
    output: str = ""  # the output with the worst score
    max_abs: float = 0.0  # of that output, in that call
    mismatches: int = 0  # integer entries that differed, over all calls

    def add(self, diffs: list[OutputDiff]) -> None:
        self.calls += 1
        self.mismatches += sum(d.mismatches for d in diffs)
        for d in diffs:
            if not self.output or d.score > self.score:
                self.score, self.output, self.max_abs = d.score, d.name, d.max_abs


def _rank(entries: list[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (-e.score, -e.mismatches, e.kind, e.layer))


@dataclass
class DiffReport:
    bundle: Path
    tolerance: float
    prompts: int
    layers: list[Entry] = field(default_factory=list)  # one per (kind, layer), worst first

    def kinds(self) -> list[Entry]:
        """One entry per kind (its worst layer's score and output, calls over all layers), worst first."""
        out: dict[str, Entry] = {}
        for e in self.layers:
            k = out.setdefault(e.kind, Entry(e.kind, e.layer))
            if e.score > k.score or not k.output:
                k.layer, k.score, k.output, k.max_abs = e.layer, e.score, e.output, e.max_abs
            k.calls += e.calls
            k.mismatches += e.mismatches
        return _rank(list(out.values()))

    def failing(self) -> list[Entry]:
        return [e for e in self.kinds() if not e.score <= self.tolerance]


def _host(x, spec) -> torch.Tensor:
    """A tensor the session passed or got back, as a host tensor (device tensors are read back)."""
    if isinstance(x, torch.Tensor):
        return x
    return x.to_torch(getattr(torch, spec.dtype), spec.shape)


class References:
    """The eager region of every kind, rebound per call to one layer's rows of the bundle's stacks."""

    def __init__(self, session, rank: int = 0):
        from deepinfer.compiler.plan import plan_regions
        from deepinfer.quant.formats import FP8_E4M3FN, FP8_FORMATS
        from deepinfer.runtime.bundle import stack_tensors

        m = session.manifest
        try:
            entries = m.rank_weights(rank)
        except BundleError as e:
            raise BundleError(f"{session.path}: {e}") from None
        # the fp8 format the weight recipe stored (the regions decode what the bundle holds)
        fp8 = {t.format for e in entries for t in e.tensors.values() if t.format in FP8_FORMATS}
        if len(fp8) > 1:
            raise BundleError(f"{session.path}: fp8 weights in several formats ({', '.join(sorted(fp8))})")
        plan = plan_regions(
            session.config.text,
            session.dtype,
            m.model.cache_quant,  # shaped for one rank
            m.topology.topology,
            fp8.pop() if fp8 else FP8_E4M3FN,
            device_embedding=m.embed is not None,
            draft=m.draft is not None,
        )
        self.regions = {kind: kp.region for kind, kp in plan.kinds.items()}
        self.rank = torch.tensor(rank, dtype=torch.int64)
        self.stacks = {e.kind: stack_tensors(session.path, e) for e in entries}
        self.rows = {(layer, slot): b.index for layer, slot, b in m.bindings()}
        missing = sorted({e.kind for e in m.regions} - set(self.regions))
        if missing:
            raise BundleError(
                f"{session.path}: region kind(s) {', '.join(missing)} have no reference region "
                "in this deepinfer (bundle from another version?)"
            )

    def bind(self, layer: int, slot: str, kind: str):
        """The reference region of `kind` holding layer `layer`'s weights."""
        region, stacks, row = self.regions[kind], self.stacks[kind], self.rows[(layer, slot)]
        for name, buf in list(region.named_buffers()):
            value = self.rank if name == "rank" else stacks[name][row]
            if value.shape != buf.shape or value.dtype != buf.dtype:
                raise BundleError(
                    f"{kind}.{name}: row {row} of the bundle's stack is {tuple(value.shape)} "
                    f"{value.dtype}, the reference region holds {tuple(buf.shape)} {buf.dtype}"
                )
            setattr(region, name, value)
        return region


class Recorder:
    """The run's `on_call`: runs each call on the executable and on its reference region, scores it."""

    def __init__(self, session, references: References):
        self.refs = references
        self.entries: dict[tuple[str, int], Entry] = {}
        self.specs, self.outputs = {}, {}
        for e in session.manifest.regions:
            self.specs[e.kind] = [s for s in e.inputs if s.role not in ("weight", "rank")]
            self.outputs[e.kind] = e.outputs

    def __call__(self, layer: int, slot: str, kind: str, inputs: tuple, run):
        specs = self.specs[kind]
        before = [_host(x, s).clone() for x, s in zip(inputs, specs)]  # state as it was before the call
        out = run()
        region = self.refs.bind(layer, slot, kind)
        with torch.no_grad():
            ref = region.decode(*before)  # writes its state into the copies
        ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
        names = self.outputs[kind]
        if len(out) != len(ref) or len(ref) != len(names):
            raise BundleError(
                f"{kind}: the executable returns {len(out)} outputs, the reference region "
                f"{len(ref)}, the manifest names {len(names)}"
            )
        try:
            diffs = [compare_tensors(n, torch.as_tensor(g), r) for n, g, r in zip(names, out, ref)]
            for i, s in enumerate(specs):
                if s.role == "state":
                    diffs.append(compare_tensors(f"{s.name} (state)", _host(inputs[i], s), before[i]))
        except ShapeMismatch as e:
            raise BundleError(f"{kind}: {e}") from None
        self.entries.setdefault((kind, layer), Entry(kind, layer)).add(diffs)
        return out


def diff_session(
    session, prompts: list[list[int]], max_new_tokens: int = 4, *, tolerance: float | None = None
) -> DiffReport:
    """Generate with a loaded bundle (`runtime.Executor`), every region call checked against its reference region."""
    from deepinfer.runtime import RunOptions
    from deepinfer.runtime.generation import generate_loaded

    recorder = Recorder(session, References(session, session.rank))
    generate_loaded(session, prompts, RunOptions(max_new_tokens=max_new_tokens), on_call=recorder)
    tol = TOLERANCE[session.manifest.model.dtype] if tolerance is None else tolerance
    return DiffReport(session.path, tol, len(prompts), _rank(list(recorder.entries.values())))


def diff_bundle(
    bundle,
    prompts: list[list[int]],
    max_new_tokens: int = 4,
    *,
    tolerance: float | None = None,
    verify: bool = True,
    num_kv_blocks: int | None = None,
    rank: int = 0,
) -> DiffReport:
    """Load `bundle` (a path, validated as `deepinfer-run` does, or an opened runtime.Bundle) and
    `diff_session` it."""
    from deepinfer.runtime import load

    session = load(bundle, num_kv_blocks=num_kv_blocks, verify=verify, rank=rank)
    try:
        return diff_session(session, prompts, max_new_tokens, tolerance=tolerance)
    finally:
        session.close()


def _layer(layer: int) -> str:
    return "-" if layer < 0 else str(layer)


def table_lines(report: DiffReport, *, per_layer: bool = False) -> list[str]:
    """Kinds (or kinds x layers) ranked worst first."""
    rows = report.layers if per_layer else report.kinds()
    head = (
        f"{'region kind':<24}{'layer' if per_layer else 'worst layer':>12}{'calls':>7}"
        f"{'worst rel diff':>16}{'max abs':>11}  {'worst output':<20}{'int mismatches':>15}  verdict"
    )
    lines = [head]
    for e in rows:
        verdict = "ok" if e.score <= report.tolerance else "DIFFERS"
        lines.append(
            f"{e.kind:<24}{_layer(e.layer):>12}{e.calls:>7}{e.score:>16.3g}{e.max_abs:>11.3g}  "
            f"{e.output:<20}{e.mismatches:>15}  {verdict}"
        )
    bad = report.failing()
    calls = sum(e.calls for e in report.layers)
    lines.append(
        f"{calls} region calls over {report.prompts} prompt(s); tolerance {report.tolerance:.3g} "
        f"(rel diff, or the fraction of integer entries that differ): "
        + (f"{len(bad)} kind(s) differ: {', '.join(e.kind for e in bad)}" if bad else "every kind agrees")
    )
    return lines


def _json(e: Entry) -> dict:
    score = e.score if math.isfinite(e.score) else str(e.score)
    return {
        "kind": e.kind,
        "layer": e.layer,
        "calls": e.calls,
        "worst_rel_diff": score,
        "max_abs": e.max_abs if math.isfinite(e.max_abs) else str(e.max_abs),
        "worst_output": e.output,
        "int_mismatches": e.mismatches,
    }


def report_json(report: DiffReport) -> dict:
    return {
        "bundle": str(report.bundle),
        "tolerance": report.tolerance,
        "prompts": report.prompts,
        "kinds": [_json(e) for e in report.kinds()],
        "layers": [_json(e) for e in report.layers],
        "differ": [e.kind for e in report.failing()],
    }
