"""Regenerate tests/golden/tiny_seed0.json (text) and tiny_vision_seed0.json (an image
prompt) from the reference on the seed-0 tiny checkpoint, and check runs against them.

    python tests/golden/regenerate.py [text] [vision]      # both when none is named

Run it only when a change to the model's semantics is intended, and say why in
the commit: these files are the regression anchors for every later stage.

A golden must hold on any x86 CPU and thread count, not at one machine's last
bit. Each mode records its noise: how far the reference drifts from itself when
only the summation order changes (prompts fed token by token and in chunks of
3 instead of one chunk), the drift of the logits' max and logsumexp over every
position both runs saw the same tokens. A run is held to the golden within
`tolerance` = max(the mode's stated floor, 4 x that drift), and where it picks
another token than the golden it must be at a near tie of the golden (its top-2
margin within the tolerance): the comparison stops there, as later positions
saw other tokens (`check_run`).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

GOLDEN = Path(__file__).with_name("tiny_seed0.json")
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog, twice over.", "abc", "1 + 1 ="]
# (dtype, cache quantization, indexer tie rule): "nemo" is the reference's default;
# "lowest" is what compiled bundles compute (the golden they are held to).
MODES = [
    ("fp32", False, "nemo"),
    ("fp32", True, "nemo"),
    ("bf16", True, "nemo"),
    ("fp32", True, "lowest"),
    ("fp32", False, "lowest"),
]


def mode_name(dtype: str, quant: bool, ties: str) -> str:
    return f"{dtype}-{'quant' if quant else 'noquant'}" + ("-lowest" if ties == "lowest" else "")


MAX_NEW = 16


# the least tolerance per mode, whatever the drift measured here: fp32 rounding; with cache quantization a
# last-bit difference can cross an fp8/fp4 rounding boundary on another CPU (seen: 1.3e-3 on an AMX machine)
STATED = {
    "fp32-noquant": 1e-4,
    "fp32-quant": 0.05,
    "bf16-quant": 0.5,
    "fp32-quant-lowest": 0.05,
    "fp32-noquant-lowest": 1e-4,
}
MARGIN = 4.0
PERTURB_CHUNKS = (1, 3)


def summary(logits: list[torch.Tensor]) -> list[list[float]]:
    """Per position: argmax, max logit, logsumexp, mean, and the top-1 minus top-2 margin."""
    L = torch.stack(logits).float()
    top2 = L.topk(2, dim=-1).values
    return [
        [int(i), float(m), float(s), float(a), float(g)]
        for i, m, s, a, g in zip(L.argmax(-1), L.amax(-1), L.logsumexp(-1), L.mean(-1), top2[:, 0] - top2[:, 1])
    ]


def drift(a: list[list[float]], b: list[list[float]], tokens_a: list[int], tokens_b: list[int]) -> float:
    """The largest |max| and |logsumexp| difference of two summaries over the positions fed the same tokens."""
    same = next((j for j, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), min(len(tokens_a), len(tokens_b)))
    rows = list(zip(a, b))[: max(0, same)]
    return max((abs(x[k] - y[k]) for x, y in rows for k in (1, 2)), default=0.0)


def check_run(tokens: list[int], logits: list[torch.Tensor], want: dict, tolerance: float) -> None:
    """A run (its tokens, prompt then generated, and one logits row per position) against a golden
    run: the same prompt; the same greedy tokens, or another one only at a near tie of the golden, where
    the comparison stops; the logits' max and logsumexp within `tolerance` up to there."""
    prompt = want["prompt_ids"]
    assert tokens[: len(prompt)] == prompt, (want["prompt"], tokens[: len(prompt)])
    golden = prompt + want["generated_ids"]
    got = summary(logits)
    assert len(got) == len(want["logits_summary"]), (want["prompt"], len(got), len(want["logits_summary"]))
    for j, (a, b) in enumerate(zip(got, want["logits_summary"])):
        assert max(abs(a[1] - b[1]), abs(a[2] - b[2])) <= tolerance, (want["prompt"], j, a, b, tolerance)
        if a[0] != b[0]:
            assert b[4] <= tolerance, (
                f"{want['prompt']!r} position {j}: argmax {a[0]}, golden {b[0]} "
                f"with margin {b[4]:.3g} > tolerance {tolerance:.3g}"
            )
            return  # a near tie went the other way: later rows saw other tokens
        if j + 1 < len(golden) and j + 1 >= len(prompt):
            assert tokens[j + 1] == golden[j + 1], (want["prompt"], j + 1)


def noise(ckpt: Path, prompts: list, modes, max_new: int, images=None) -> dict:
    """Per mode: the drift of the reference from itself under other prompt chunkings, and the tolerance.

    The drift is a property of the dtype and cache quantization, measured with the lowest-index tie
    rule: NeMo's rule picks among tied scores by the forward's width, so under other chunkings it would
    measure the rule, not rounding (goldens are generated and checked with prompts in one chunk)."""
    from deepinfer.regions.reference import ReferenceModel
    from deepinfer.runtime.schedule import decode_model

    drifts = {}
    for dtype, quant in dict.fromkeys((d, q) for d, q, _ in modes):
        model = ReferenceModel(ckpt, dtype=dtype, cache_quant=quant, ties="lowest")
        base = decode_model(model, prompts, max_new, images=images)
        drifts[dtype, quant] = max(
            drift(summary(g.logits), summary(h.logits), g.tokens, h.tokens)
            for chunk in PERTURB_CHUNKS
            for g, h in zip(base, decode_model(model, prompts, max_new, chunk=chunk, images=images))
        )
    return {
        mode_name(d, q, t): {"drift": drifts[d, q], "tolerance": max(STATED[mode_name(d, q, t)], MARGIN * drifts[d, q])}
        for d, q, t in modes
    }


def generate_all(ckpt: Path) -> dict:
    from deepinfer.regions.reference import ReferenceModel
    from deepinfer.regions.tokenizer import ByteTokenizer
    from deepinfer.runtime.schedule import decode_model

    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    out = {"checkpoint": "make-tiny seed 0, 6 layers", "max_new_tokens": MAX_NEW, "modes": {}}
    for dtype, quant, ties in MODES:
        model = ReferenceModel(ckpt, dtype=dtype, cache_quant=quant, ties=ties)
        gens = decode_model(model, prompts, MAX_NEW)
        out["modes"][mode_name(dtype, quant, ties)] = [
            {
                "prompt": text,
                "prompt_ids": g.tokens[: g.prompt_len],
                "generated_ids": g.generated,
                "logits_summary": summary(g.logits),
            }
            for text, g in zip(PROMPTS, gens)
        ]
    out["noise"] = noise(ckpt, prompts, MODES, MAX_NEW)
    return out


# --- the vision golden: one synthetic image (5 x 7 patches: neither divisible by the 2 x 2 merge) ---

VISION_GOLDEN = Path(__file__).with_name("tiny_vision_seed0.json")
VISION_PROMPTS = ["<image>Hi", "Look:<image>"]  # the span fits the 32-position test bundles
VISION_MODES = [("fp32", False, "nemo"), ("fp32", True, "lowest")]
VISION_MAX_NEW = 8
IMAGE_SIZE = (20, 28)  # height, width in pixels (patch 4)


def gradient_image(height: int = IMAGE_SIZE[0], width: int = IMAGE_SIZE[1]):
    """uint8 [H, W, 3]: red down the rows, green across the columns, a blue diagonal ripple."""
    import numpy as np

    y, x = np.mgrid[0:height, 0:width]
    return np.stack([y * 255 // (height - 1), x * 255 // (width - 1), (x + 2 * y) * 23 % 256], -1).astype(np.uint8)


def image_prompts(model, texts=VISION_PROMPTS):
    """(token ids, ImageEmbeds) per prompt, the gradient image at each prompt's <image> marker."""
    from deepinfer.regions.spans import with_images
    from deepinfer.regions.tokenizer import ByteTokenizer

    c = model.config
    span = model.vision.embed(gradient_image())
    return [
        with_images(ByteTokenizer().encode(t, image_token=c.image_token_id), [span], c.image_token_id, c.bos_token_id)
        for t in texts
    ]


def generate_vision(ckpt: Path) -> dict:
    from deepinfer.regions.reference import ReferenceModel
    from deepinfer.runtime.schedule import decode_model

    out = {
        "checkpoint": "make-tiny seed 0, 6 layers",
        "image": {"kind": "gradient", "size": list(IMAGE_SIZE)},
        "max_new_tokens": VISION_MAX_NEW,
        "modes": {},
    }
    for dtype, quant, ties in VISION_MODES:
        model = ReferenceModel(ckpt, dtype=dtype, cache_quant=quant, ties=ties)
        placed = image_prompts(model)
        if "span" not in out:  # per span position: mean and RMS of the fp32 tower's embedding
            rows = placed[0][1].embeds[placed[0][1].mask].double()
            out["span"] = [[float(r.mean()), float(r.square().mean().sqrt())] for r in rows]
        gens = decode_model(model, [ids for ids, _ in placed], VISION_MAX_NEW, images=[e for _, e in placed])
        out["modes"][mode_name(dtype, quant, ties)] = [
            {
                "prompt": text,
                "prompt_ids": g.tokens[: g.prompt_len],
                "generated_ids": g.generated,
                "logits_summary": summary(g.logits),
            }
            for text, g in zip(VISION_PROMPTS, gens)
        ]
    out["noise"] = noise(ckpt, [ids for ids, _ in placed], VISION_MODES, VISION_MAX_NEW, images=[e for _, e in placed])
    return out


def write_golden(path: Path, data: dict) -> None:
    modes = ",\n".join(
        f' "{m}": [\n  ' + ",\n  ".join(json.dumps(r) for r in runs) + "\n ]" for m, runs in data["modes"].items()
    )
    head = json.dumps({k: v for k, v in data.items() if k != "modes"})[:-1]
    path.write_text(head + ', "modes": {\n' + modes + "\n}}\n")
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    from deepinfer.regions.tiny import make_tiny

    which = sys.argv[1:] or ["text", "vision"]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny(Path(tmp) / "tiny")
        if "text" in which:
            write_golden(GOLDEN, generate_all(ckpt))
        if "vision" in which:
            write_golden(VISION_GOLDEN, generate_vision(ckpt))


if __name__ == "__main__":
    main()
