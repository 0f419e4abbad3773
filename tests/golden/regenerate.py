"""Regenerate tests/golden/tiny_seed0.json from the reference on the seed-0 tiny checkpoint.

    python tests/golden/regenerate.py

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


def main() -> None:
    from deepinfer.regions.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        data = generate_all(make_tiny(Path(tmp) / "tiny"))
    modes = ",\n".join(f' "{m}": [\n  ' + ",\n  ".join(json.dumps(r) for r in runs) + "\n ]"
                       for m, runs in data["modes"].items())
    head = json.dumps({k: v for k, v in data.items() if k != "modes"})[:-1]
    GOLDEN.write_text(head + ', "modes": {\n' + modes + "\n}}\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)


if __name__ == "__main__":
    main()
