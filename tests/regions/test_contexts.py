"""Context buckets: which bucket a step runs, that a narrower block table computes what the full one does,
and how the manifest records and checks each executable's bucket."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from deepinfer.bundles import manifest as mf
from deepinfer.bundles import manifest_io
from deepinfer.bundles.manifest import BundleError
from deepinfer.regions.reference import REFERENCE_BLOCK_SIZE, EagerSteps
from deepinfer.regions.step import run_layers
from deepinfer.regions.stepper import make_batch, table_width
from deepinfer.runtime.schedule import decode, decode_model

# --- the bucket a step runs ---


@pytest.mark.parametrize(
    "rows, want",
    [
        ([[(0, [7], 0)]], 1),  # writes position 0
        ([[(0, [7], 15)]], 1),  # position 15: the 16th, still one block
        ([[(0, [7], 16)]], 4),  # position 16 needs a second block: the 4-block bucket
        ([[(0, [7] * 8, 60)]], 8),  # a chunk ending at position 67: 5 blocks
        ([[(0, [7], 3)], [(1, [7, 7], 100)]], 8),  # the longest row of any group decides
        ([[(0, [7], 3), (2, [7] * 4, 124)]], 8),  # positions 124..127: exactly 8 blocks
    ],
)
def test_step_runs_the_smallest_bucket_holding_its_longest_sequence(rows, want):
    widths = [1, 4, 8]  # buckets of 16, 64 and 128 positions at block size 16
    longest = max(start + len(ids) for group in rows for _, ids, start in group)
    assert table_width(rows, 16, widths) == want
    assert want * 16 >= longest and all(w * 16 < longest for w in widths if w < want)


def test_a_sequence_past_the_largest_bucket_has_no_bucket():
    with pytest.raises(IndexError):
        table_width([[(0, [7], 128)]], 16, [1, 4, 8])


# --- a narrower block table computes what the full one does (eager regions, per-step widths) ---


class _Bucketed(EagerSteps):
    """The reference's stepper, each step's block tables as narrow as a bucket allows (the runtime's rule),
    from `widths` in blocks; `seen` records the widths the steps ran."""

    def __init__(self, *args, widths: list[int]):
        super().__init__(*args)
        self.widths, self.seen = widths, []

    def run(self, rows_by_group, allocs, histories, images, capture=None, last_only=False, greedy=False):
        m, (rows,) = self.model, rows_by_group
        T = max(len(ids) for _, ids, _ in rows)
        blocks = table_width(rows_by_group, REFERENCE_BLOCK_SIZE, self.widths)
        self.seen.append(blocks)
        batch = make_batch(
            rows,
            [seq for seq, _, _ in rows],
            self.max_batch,
            T,
            blocks=blocks,
            alloc=allocs[0],
            histories=histories,
            images=images,
            hasher=m.hasher,
            pad=m.config.pad_token_id,
            dtype=m.dtype,
        )
        h, pre = m.embed(batch.tokens, batch.is_image, batch.image_rows)
        return [run_layers(m.plans, m.invoke, self.states, h, pre, batch, m.engram)[[seq for seq, _, _ in rows]]]


def test_narrow_block_tables_generate_what_the_full_width_does(ref_fp32):
    """Prompts of 5 and 12 tokens (in chunks of 4) generating 6 more, batched: the second crosses into a
    second block while generating. Each step at its narrowest bucket (1 or 2 blocks) against the
    reference's one width: the same tokens; the logits within fp32 rounding (the attention's softmax
    may see another number of masked keys)."""
    prompts = [[0, 72, 101, 108, 108], [0] + list(range(40, 51))]
    new = 6
    want = decode_model(ref_fp32, prompts, new, chunk=4)
    stepper = _Bucketed(ref_fp32, prompts, new, 4, widths=[1, 2])
    with torch.inference_mode():
        got = decode(stepper, prompts, new, eos=ref_fp32.config.eos_token_id)
    assert stepper.seen[0] == 1 and stepper.seen[-1] == 2 and stepper.seen == sorted(stepper.seen)
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens
        torch.testing.assert_close(torch.stack(g.logits), torch.stack(w.logits), rtol=0, atol=1e-4)


# --- the manifest: each executable's context bucket, checked ---


def _exe(kind: str, context: int | None, *, table: int | None = None) -> mf.Executable:
    inputs = (mf.TensorSpec(name="h", shape=(1, 1, 4, 8), dtype="float32", role="activation"),)
    if table is not None:
        inputs += (mf.TensorSpec(name="block_table", shape=(1, table), dtype="int64", role="step"),)
    e = mf.Executable(
        kind=kind,
        method="decode",
        bucket=mf.Shape(batch=1, tokens=1, context=context),
        artifact="",
        executable="exported",
        inputs=inputs,
        outputs=("h",),
        output_specs=(mf.TensorSpec(name="h", shape=(1, 1, 4, 8), dtype="float32"),),
    )
    return dataclasses.replace(e, artifact=f"regions/{e.name}.pt2")


def small_manifest(contexts: tuple[int, ...] = (16, 48)) -> mf.Manifest:
    """Three kinds over one layer: attention built per context bucket (block size 16), moe and head not."""
    kinds = ("attn_source_r2", "moe", "head")
    regions = tuple(_exe("attn_source_r2", c, table=-(-c // 16)) for c in contexts)
    regions += (_exe("moe", None), _exe("head", None))
    stacks = tuple(
        mf.WeightStack(kind=k, path=f"weights/rank-0/{k}.safetensors", layers=(0,), tensors={}) for k in kinds
    )
    return mf.Manifest(
        format_version=mf.FORMAT_VERSION,
        deepinfer_version="0",
        toolchain={},
        target=mf.Target(name="cpu", executable="exported"),
        topology=mf.Ranks(tp=1, ep=1, cp=1, world_size=1, groups=1, dispatch=False),
        model=mf.Model(
            config={},
            config_hash="",
            dtype="fp32",
            cache_quant=False,
            weight_format="e4m3fn",
            scale_layout="ue8m0-u8-row-major",
        ),
        buckets=mf.Buckets(shapes=(mf.Shape(batch=1, tokens=1),), max_context=contexts[-1], contexts=contexts),
        kv=mf.KV(
            block_size=16,
            num_blocks=4,
            slots=2,
            max_blocks=-(-contexts[-1] // 16),
            scratch="block 0",
            pools={},
            state_writes="in place",
            static_pools=False,
        ),
        regions=regions,
        head=mf.Binding(kind="head", index=0),
        layers=(
            mf.Layer(
                layer=0,
                attn="source",
                ratio=2,
                kv_source=0,
                candidate_source=False,
                uses_candidates=False,
                engram=False,
                state={},
                regions={"attn": mf.Binding(kind="attn_source_r2", index=0), "moe": mf.Binding(kind="moe", index=0)},
            ),
        ),
        weights={"rank-0": stacks},
        host={"embed": mf.HostFile(path="host/embed.safetensors")},
    )


def parse_error(data) -> str:
    with pytest.raises(BundleError) as e:
        manifest_io.parse(data, "m.json")
    message = str(e.value)
    assert message.startswith("m.json: ") and "\n" not in message, message
    return message


def test_manifest_records_each_executables_context_bucket():
    m = small_manifest()
    data = manifest_io.to_json(m)
    assert data["buckets"]["contexts"] == [16, 48]
    by_name = {e["artifact"]: e["bucket"] for e in data["regions"]}
    assert by_name == {
        "regions/attn_source_r2.decode.b1t1c16.pt2": {"batch": 1, "tokens": 1, "context": 16},
        "regions/attn_source_r2.decode.b1t1c48.pt2": {"batch": 1, "tokens": 1, "context": 48},
        "regions/moe.decode.b1t1.pt2": {"batch": 1, "tokens": 1},  # context-free: absent
        "regions/head.decode.b1t1.pt2": {"batch": 1, "tokens": 1},
    }
    assert manifest_io.parse(json.loads(json.dumps(data)), "m.json") == m


def test_a_manifest_without_context_buckets_has_one_at_max_context():
    """Bundles written before context buckets: no `contexts`, no executable with a context."""
    data = manifest_io.to_json(small_manifest((48,)))
    del data["buckets"]["contexts"]
    for e in data["regions"]:
        e["bucket"].pop("context", None)
    m = manifest_io.parse(data, "m.json")
    assert m.buckets.context_sizes == [48] and all(e.bucket.context is None for e in m.regions)


def _edit(fn):
    data = manifest_io.to_json(small_manifest())
    fn(data)
    return data


def _attn(data, context):
    return next(e for e in data["regions"] if e["bucket"].get("context") == context)


DAMAGE = {
    "contexts not ascending": (
        lambda d: d["buckets"].update(contexts=[48, 16]),
        "buckets.contexts: expected ascending",
    ),
    "contexts not ending at max_context": (
        lambda d: d["buckets"].update(contexts=[16, 32]),
        "buckets.contexts: expected ascending positive context lengths ending at max_context 48",
    ),
    "unknown bucket": (
        lambda d: _attn(d, 48)["bucket"].update(context=32),
        "regions[1].bucket.context: 32 is not one of the context buckets [16, 48]",
    ),
    "missing bucket": (
        lambda d: d["regions"].remove(_attn(d, 16)),
        "kind 'attn_source_r2' has executables for [] at context 16, not one for each of the 1",
    ),
    "a context on a context-free kind": (
        lambda d: d["regions"][2]["bucket"].update(context=16),
        "kind 'moe' has executables for [] at context 48",
    ),
    "table of another width": (
        lambda d: _attn(d, 16)["inputs"][1].update(shape=[1, 3]),
        "regions[0].inputs[1].shape: block table [1, 3]: expected 1 blocks for context 16",
    ),
    "a block table without a bucket": (
        lambda d: [e["bucket"].pop("context") for e in d["regions"][:2]],
        "takes a block table but has no context bucket (the bundle has [16, 48])",
    ),
    "max_blocks": (lambda d: d["kv"].update(max_blocks=2), "kv.max_blocks: 2 blocks do not hold max_context 48"),
    "context type": (lambda d: _attn(d, 16)["bucket"].update(context="16"), "bucket.context: expected int"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_context_buckets_are_one_line_naming_the_key(damage):
    edit, message = DAMAGE[damage]
    assert message in parse_error(_edit(edit))
