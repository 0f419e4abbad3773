"""Regenerate tests/golden/tiny_seed0.json (text) and tiny_vision_seed0.json (an image
prompt) from the reference on the seed-0 tiny checkpoint.

    python tests/golden/regenerate.py [text] [vision]      # both when none is named

Run it only when a change to the model's semantics is intended, and say why in
the commit: these files are the regression anchors for every later stage.
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
MODES = [("fp32", False, "nemo"), ("fp32", True, "nemo"), ("bf16", True, "nemo"), ("fp32", True, "lowest"),
         ("fp32", False, "lowest")]


def mode_name(dtype: str, quant: bool, ties: str) -> str:
    return f"{dtype}-{'quant' if quant else 'noquant'}" + ("-lowest" if ties == "lowest" else "")
MAX_NEW = 16


def summary(logits: list[torch.Tensor]) -> list[list[float]]:
    """Per position: argmax, max logit, logsumexp, mean."""
    L = torch.stack(logits).float()
    return [[int(i), float(m), float(s), float(a)]
            for i, m, s, a in zip(L.argmax(-1), L.amax(-1), L.logsumexp(-1), L.mean(-1))]


def generate_all(ckpt: Path) -> dict:
    from deepinfer.regions.reference import ReferenceModel
    from deepinfer.regions.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    out = {"checkpoint": "make-tiny seed 0, 6 layers", "max_new_tokens": MAX_NEW, "modes": {}}
    for dtype, quant, ties in MODES:
        model = ReferenceModel(ckpt, dtype=dtype, cache_quant=quant, ties=ties)
        gens = model.generate(prompts, MAX_NEW)
        out["modes"][mode_name(dtype, quant, ties)] = [
            {"prompt": text, "prompt_ids": g.tokens[:g.prompt_len], "generated_ids": g.generated,
             "logits_summary": summary(g.logits)} for text, g in zip(PROMPTS, gens)]
    return out


# --- the vision golden: one synthetic image (5 x 7 patches: neither divisible by the 2 x 2 merge) ---

VISION_GOLDEN = Path(__file__).with_name("tiny_vision_seed0.json")
VISION_PROMPTS = ["<image>Hi", "Look:<image>"]          # the span fits the 32-position test bundles
VISION_MODES = [("fp32", False, "nemo"), ("fp32", True, "lowest")]
VISION_MAX_NEW = 8
IMAGE_SIZE = (20, 28)                                   # height, width in pixels (patch 4)


def gradient_image(height: int = IMAGE_SIZE[0], width: int = IMAGE_SIZE[1]):
    """uint8 [H, W, 3]: red down the rows, green across the columns, a blue diagonal ripple."""
    import numpy as np

    y, x = np.mgrid[0:height, 0:width]
    return np.stack([y * 255 // (height - 1), x * 255 // (width - 1), (x + 2 * y) * 23 % 256], -1).astype(np.uint8)


def image_prompts(model, texts=VISION_PROMPTS):
    """(token ids, ImageEmbeds) per prompt, the gradient image at each prompt's <image> marker."""
    from deepinfer.regions.tokenizer import ByteTokenizer
    from deepinfer.regions.spans import with_images

    c = model.config
    span = model.vision.embed(gradient_image())
    return [with_images(ByteTokenizer().encode(t, image_token=c.image_token_id), [span], c.image_token_id,
                        c.bos_token_id) for t in texts]


def generate_vision(ckpt: Path) -> dict:
    from deepinfer.regions.reference import ReferenceModel

    out = {"checkpoint": "make-tiny seed 0, 6 layers", "image": {"kind": "gradient", "size": list(IMAGE_SIZE)},
           "max_new_tokens": VISION_MAX_NEW, "modes": {}}
    for dtype, quant, ties in VISION_MODES:
        model = ReferenceModel(ckpt, dtype=dtype, cache_quant=quant, ties=ties)
        placed = image_prompts(model)
        if "span" not in out:       # per span position: mean and RMS of the fp32 tower's embedding
            rows = placed[0][1].embeds[placed[0][1].mask].double()
            out["span"] = [[float(r.mean()), float(r.square().mean().sqrt())] for r in rows]
        gens = model.generate([ids for ids, _ in placed], VISION_MAX_NEW, images=[e for _, e in placed])
        out["modes"][mode_name(dtype, quant, ties)] = [
            {"prompt": text, "prompt_ids": g.tokens[:g.prompt_len], "generated_ids": g.generated,
             "logits_summary": summary(g.logits)} for text, g in zip(VISION_PROMPTS, gens)]
    return out


def write_golden(path: Path, data: dict) -> None:
    modes = ",\n".join(f' "{m}": [\n  ' + ",\n  ".join(json.dumps(r) for r in runs) + "\n ]"
                       for m, runs in data["modes"].items())
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
