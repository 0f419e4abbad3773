"""Where a prompt's images go: image spans in the token sequence and their rows in a step.

The vision tower (regions/vision.py) turns an image into its span's embeddings;
these helpers place spans in a prompt (`with_images`), cut a step's part of
them (`step_images`) and hand the engram hasher the image positions it skips
(`engram_masks`). Pure torch: the runtime uses them without the tower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer.errors import ImageError


@dataclass
class ImageEmbeds:
    """The image positions of one prompt and the vectors that replace their token embeddings."""

    mask: Tensor  # [L] bool: every position of every image span
    embeds: Tensor  # [L, D]: the span rows at those positions (zero elsewhere)


def with_images(ids: list[int], images: list[Tensor], image_token_id: int, bos: int) -> tuple[list[int], ImageEmbeds]:
    """Replace each `image_token_id` placeholder of `ids` by the next image's span (`images[i]`
    [tokens_i, D] from `VisionTower.embed`); without placeholders the images go, in order,
    after a leading bos (else first). Span positions carry `image_token_id`."""
    slots = [i for i, t in enumerate(ids) if t == image_token_id]
    if not slots:
        at = 1 if ids and ids[0] == bos else 0
        ids = ids[:at] + [image_token_id] * len(images) + ids[at:]
        slots = list(range(at, at + len(images)))
    if len(slots) != len(images):
        raise ImageError(
            f"the prompt has {len(slots)} image placeholder(s) (<image> or token {image_token_id}) "
            f"but {len(images)} image(s) were given"
        )
    out, rows, mask = [], [], []
    last = 0
    D = images[0].shape[-1] if images else 0
    for slot, span in zip(slots, images):
        out += ids[last:slot]
        rows.append(torch.zeros(slot - last, D, dtype=span.dtype))
        mask += [False] * (slot - last)
        out += [image_token_id] * span.shape[0]
        rows.append(span)
        mask += [True] * span.shape[0]
        last = slot + 1
    out += ids[last:]
    dtype = images[0].dtype if images else torch.float32
    rows.append(torch.zeros(len(ids) - last, D, dtype=dtype))
    return out, ImageEmbeds(torch.tensor(mask + [False] * (len(ids) - last), dtype=torch.bool), torch.cat(rows))


def step_images(
    images: list[ImageEmbeds | None] | None, spans: list[tuple[int, int]], T: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """One step's is_image [B, T] and replacement rows [B, T, D] (None without images).

    spans[b] = (first position, count) of row b's tokens in this step (count 0: idle row).
    """
    B = len(spans)
    is_image = torch.zeros((B, T), dtype=torch.bool)
    if not images or all(im is None for im in images):
        return is_image, None
    D = next(im for im in images if im is not None).embeds.shape[-1]
    rows = torch.zeros((B, T, D), dtype=dtype)
    for b, (start, count) in enumerate(spans):
        im = images[b] if b < len(images) else None
        if im is None or start >= im.mask.shape[0]:
            continue
        n = min(count, im.mask.shape[0] - start)
        is_image[b, :n] = im.mask[start : start + n]
        rows[b, :n] = im.embeds[start : start + n].to(dtype)
    return is_image, rows


def engram_masks(images: list[ImageEmbeds | None] | None, rows: list[int]) -> list | None:
    """Per batch row, the prompt's image mask (numpy) for the engram hasher (None without images)."""
    if not images:
        return None
    return [None if b >= len(images) or (im := images[b]) is None else im.mask.numpy() for b in rows]
