"""Regenerate tests/golden/nemo_dspark_fp32.json with NeMo AutoModel 0.7.0's DSpark draft.

    python tests/golden/nemo_dspark.py CHECKPOINT   # in a venv with nemo-automodel==0.7.0 (MODEL.md)

CHECKPOINT is the seed-0, 6-layer `deepinfer make-tiny` checkpoint (with its draft). The script
builds `DeepseekV41DSparkModel` (fp32, BackendConfig attn=eager linear=torch rms_norm=torch_fp32
experts=torch, `quantize_cache` replaced by the identity: cache quantization off), loads the
checkpoint's `embed.weight`, `head.weight` and `mtp.*` through its own
`DeepseekV41DSparkStateDictAdapter.from_hf`, and runs its backbone on one block: seeded random
target features for CONTEXT positions, the anchor at position CONTEXT, noise tokens after it, and
a teacher-forced previous-token row. It records the inputs and, per block position, the draft
logits (the frozen head's plus the Markov transition) and the confidence logit. Without NeMo it
exits with a one-line message and leaves the golden alone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "nemo_dspark_fp32.json"
CONTEXT = 11  # target positions 0..10; the tiny window (8) sees 3..10
ANCHOR_TOKEN = 104
PREVIOUS = [104, 111, 32, 119, 111]  # the anchor, then the tokens after it (teacher-forced)
SEED = 1234


def main() -> None:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    try:
        import nemo_automodel.components.models.deepseek_v41.dspark as dspark
        import torch
        from nemo_automodel.components.models.common import BackendConfig
        from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
        from safetensors.torch import load_file
    except ImportError as e:
        sys.exit(f"nemo_dspark.py: needs nemo-automodel 0.7.0 and torch ({e}); the golden is unchanged")
    ckpt = Path(sys.argv[1])
    config = json.loads((ckpt / "config.json").read_text())
    text = {k: v for k, v in config["text_config"].items() if k != "model_type"}
    c = DeepseekV41TextConfig(**text, dtype="float32")
    dspark.quantize_cache = lambda values, **kwargs: values
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", dispatcher="torch", experts="torch")
    torch.manual_seed(0)
    model = dspark.DeepseekV41DSparkModel(c, backend, num_anchors=1, enable_confidence_head=True).float()
    tensors = {
        k: v
        for k, v in load_file(str(ckpt / "model.safetensors")).items()
        if k in ("embed.weight", "head.weight") or k.startswith("mtp.")
    }
    native = model.state_dict_adapter.from_hf(tensors)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in native.items()}, strict=False)
    assert not unexpected and not [k for k in missing if "_extra_state" not in k], (missing, unexpected)

    D, L, P = c.hidden_size, len(c.dspark_target_layer_ids), c.dspark_block_size
    g = torch.Generator().manual_seed(SEED)
    features = torch.randn(1, CONTEXT, L * D, generator=g)
    anchor = torch.tensor([[CONTEXT]])
    block = torch.full((1, P), c.dspark_noise_token_id)
    block[0, 0] = ANCHOR_TOKEN
    with torch.no_grad():
        noise = model.embed_tokens(block).float()
        out = dspark.DeepseekV41DSparkBackbone.forward(
            model,
            noise,
            features,
            position_ids=model.build_position_ids(anchor, CONTEXT),
            attention_mask=model.build_attention_mask(
                anchor, torch.ones(1, 1, dtype=torch.bool), CONTEXT, torch.float32
            ),
            previous_token_ids=torch.tensor([PREVIOUS]),
        )
        logits = model.compute_logits(out.normalized_hidden_states) + out.transition_logits.float()
    GOLDEN.write_text(
        json.dumps(
            {
                "source": "NeMo AutoModel 0.7.0 deepseek_v41 DeepseekV41DSparkModel (BackendConfig attn=eager linear=torch "
                "rms_norm=torch_fp32 experts=torch), float32, quantize_cache replaced by identity, on the seed-0 "
                "6-layer make-tiny checkpoint's mtp.* (tests/golden/nemo_dspark.py)",
                "anchor_position": CONTEXT,
                "anchor_token": ANCHOR_TOKEN,
                "previous": PREVIOUS,
                "features": [[round(x, 7) for x in row] for row in features[0].tolist()],
                "logits": [[round(x, 6) for x in row] for row in logits[0].tolist()],
                "confidence": [round(x, 6) for x in out.confidence_pred[0].tolist()],
            }
        )
        + "\n"
    )
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
