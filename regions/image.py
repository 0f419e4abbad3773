"""Images for the vision tower: reading files, sizing, grey padding, patches.

File formats (no imaging dependency): binary PPM/PGM (`P6`/`P5`, maxval up to
65535), PNG (8-bit, non-interlaced; grey, grey+alpha, RGB, RGBA, palette;
alpha is dropped as an RGB conversion does) and `.npy` arrays `[H, W, 3]`
(or `[H, W]`, `[H, W, 4]`) of uint8. Everything becomes `[H, W, 3]` uint8 RGB.

Sizing follows NeMo AutoModel 0.7.0's V4.1 processor (MODEL.md only says
"resize/pad to a multiple of P"): the image's logical size is clamped to
`max_wh_ratio`, scaled up to at least `min_pixels`, rounded up to multiples of
the patch size; if the text span (`rows * (cols + 1) + 2` tokens after the
r x r merge) exceeds `max_image_tokens` the largest grid of the image's
aspect that fits is used instead. The image is then fitted aspect-preserving
and centred on a grey (127, 127, 127) canvas of that size (a very wide image,
beyond `max_wh_ratio`, is stretched instead). Pixels map to [-1, 1] as
`(p / 255 - 0.5) / 0.5`; patches are cut row-major, each `[3, P, P]`.

Resampling: where the fitted size differs from the image's, the resize is
torch's antialiased bicubic (the same kernel family as PIL's BICUBIC, which
NeMo uses through Pillow), rounded to uint8; it can differ from Pillow's by a
level here and there. An image already at its grid size (the tests' images)
is used as it is, exactly as NeMo would.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from deepinfer.errors import ImageError
from deepinfer.regions.config import VisionConfig

GREY = 127
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# bounds checked before anything is decoded: an image is resized to at most max_image_tokens
# patches anyway, and a hostile file must not make the host read or allocate without limit
MAX_FILE_BYTES = 256 << 20
MAX_PIXELS = 1 << 26  # 64 Mpixel, e.g. 8192 x 8192
FORMATS = "binary PPM/PGM (P6/P5), PNG (8-bit, non-interlaced) or .npy uint8 [H, W, 3]"


# ----------------------------------------------------------------------------- reading


def read_image(path: str | Path) -> np.ndarray:
    """An image file -> uint8 [H, W, 3] RGB."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ImageError(f"{path}: cannot read the image ({e.strerror})") from None
    if len(data) > MAX_FILE_BYTES:
        raise ImageError(f"{path}: more than {MAX_FILE_BYTES:,} bytes; not read further")
    if path.suffix.lower() == ".npy":
        return _from_npy(path)
    if data[:2] in (b"P5", b"P6"):
        pixels = _from_pnm(data, path)
    elif data[:8] == PNG_SIGNATURE:
        pixels = _from_png(data, path)
    else:
        raise ImageError(f"{path}: not a supported image; give {FORMATS}")
    return _to_rgb(pixels, path)


def _check_size(width: int, height: int, path: Path) -> None:
    """Declared dimensions, before the raster is decoded or allocated."""
    if not (width > 0 and height > 0):
        raise ImageError(f"{path}: image declares {width} x {height} pixels")
    if width * height > MAX_PIXELS:
        raise ImageError(
            f"{path}: image declares {width} x {height} pixels, more than {MAX_PIXELS >> 20} Mpixel; downscale it first"
        )


def _to_rgb(pixels: np.ndarray, where) -> np.ndarray:
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.ndim != 3 or pixels.shape[2] not in (1, 2, 3, 4) or min(pixels.shape[:2]) == 0:
        raise ImageError(
            f"{where}: image array has shape {list(pixels.shape)}; expected [H, W, 3] (or [H, W], "
            "[H, W, 4]) with H, W > 0"
        )
    channels = pixels.shape[2]
    if channels in (1, 2):  # grey (+ alpha)
        pixels = np.repeat(pixels[:, :, :1], 3, axis=2)
    return np.ascontiguousarray(pixels[:, :, :3], dtype=np.uint8)


def _from_npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ImageError(f"{path}: not a readable .npy array ({e})") from None
    if array.ndim >= 2:
        _check_size(array.shape[1], array.shape[0], path)
    if array.dtype != np.uint8:
        raise ImageError(f"{path}: .npy image has dtype {array.dtype}; expected uint8 RGB values 0..255")
    return _to_rgb(array, path)


def _from_pnm(data: bytes, path: Path) -> np.ndarray:
    """Binary PGM (P5) or PPM (P6): header tokens with # comments, one whitespace byte, raster."""
    fields: list[int] = []
    i = 2
    while len(fields) < 3:
        while i < len(data) and (data[i : i + 1].isspace() or data[i : i + 1] == b"#"):
            if data[i : i + 1] == b"#":
                while i < len(data) and data[i : i + 1] not in (b"\n", b"\r"):
                    i += 1
            else:
                i += 1
        start = i
        while i < len(data) and data[i : i + 1].isdigit():
            i += 1
        if start == i:
            raise ImageError(f"{path}: malformed PPM/PGM header (expected width, height and maxval)")
        fields.append(int(data[start:i]))
    width, height, maxval = fields
    if not (width > 0 and height > 0 and 0 < maxval < 65536):
        raise ImageError(f"{path}: PPM/PGM header has width {width}, height {height}, maxval {maxval}")
    _check_size(width, height, path)
    i += 1  # the single whitespace byte
    channels = 3 if data[:2] == b"P6" else 1
    dtype = np.dtype(">u2") if maxval > 255 else np.dtype(np.uint8)
    count = width * height * channels
    if len(data) - i < count * dtype.itemsize:
        raise ImageError(
            f"{path}: PPM/PGM raster is truncated ({len(data) - i} bytes, expected {count * dtype.itemsize})"
        )
    raster = np.frombuffer(data, dtype=dtype, count=count, offset=i).reshape(height, width, channels)
    if maxval != 255:
        raster = np.round(raster.astype(np.float64) * 255 / maxval)
    return raster.astype(np.uint8)


def _from_png(data: bytes, path: Path) -> np.ndarray:
    pos, header, palette, idat = 8, None, None, []
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            if len(body) != 13:
                raise ImageError(f"{path}: malformed PNG (IHDR of {len(body)} bytes, expected 13)")
            header = struct.unpack(">IIBBBBB", body)
            _check_size(header[0], header[1], path)
        elif kind == b"PLTE":
            palette = np.frombuffer(body, dtype=np.uint8).reshape(-1, 3)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    if header is None or not idat:
        raise ImageError(f"{path}: malformed PNG (no IHDR or no image data)")
    width, height, depth, color, _, _, interlace = header
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}.get(color)
    if depth != 8 or interlace != 0 or channels is None or (color == 3 and palette is None):
        raise ImageError(
            f"{path}: PNG with bit depth {depth}, colour type {color}, interlace {interlace} is not "
            "supported (8-bit non-interlaced only); convert it, e.g. to binary PPM (P6)"
        )
    stride = width * channels
    try:  # never inflate past what the header declares
        raw = np.frombuffer(zlib.decompressobj().decompress(b"".join(idat), height * (stride + 1)), dtype=np.uint8)
    except zlib.error as e:
        raise ImageError(f"{path}: corrupt PNG image data ({e})") from None
    if raw.size < height * (stride + 1):
        raise ImageError(f"{path}: PNG image data is truncated")
    rows = raw[: height * (stride + 1)].reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prior = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        out[y] = _unfilter(rows[y, 0], rows[y, 1:], prior, channels, path)
        prior = out[y]
    pixels = out.reshape(height, width, channels)
    if color == 3:
        assert palette is not None  # a palette image without its PLTE chunk was refused above
        return palette[pixels[:, :, 0]]
    return pixels


def _unfilter(kind: int, line: np.ndarray, prior: np.ndarray, bpp: int, path: Path) -> np.ndarray:
    """One PNG scanline's filter undone (RFC 2083 section 6)."""
    if kind == 0:
        return line
    if kind == 2:
        return line + prior  # uint8 wraps as the format wants
    if kind == 1:  # sum of each byte's left neighbours
        groups = line.reshape(-1, bpp).astype(np.int64)
        return (np.cumsum(groups, axis=0) % 256).astype(np.uint8).reshape(-1)
    if kind not in (3, 4):
        raise ImageError(f"{path}: corrupt PNG (filter type {kind})")
    out = np.zeros_like(line)
    cur, up = line.astype(np.int64), prior.astype(np.int64)
    left = np.zeros(bpp, dtype=np.int64)
    for x in range(0, line.size, bpp):
        b = up[x : x + bpp]
        if kind == 3:
            pred = (left + b) // 2
        else:
            c = up[x - bpp : x] if x else np.zeros(bpp, dtype=np.int64)
            p = left + b - c
            pa, pb, pc = np.abs(p - left), np.abs(p - b), np.abs(p - c)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, b, c))
        left = (cur[x : x + bpp] + pred) % 256
        out[x : x + bpp] = left
    return out


# ----------------------------------------------------------------------------- sizing


@dataclass(frozen=True)
class ImageGrid:
    """Where one image lands: pixel size, ViT patch grid, merged grid."""

    height: int  # pixels after fitting (a multiple of the patch size)
    width: int
    rows: int  # ViT patch rows = height / P
    cols: int
    llm_rows: int  # ceil(rows / r): rows of image features in the text
    llm_cols: int

    @property
    def tokens(self) -> int:
        """Text positions of the image: start, rows of features each with a newline, end."""
        return self.llm_rows * (self.llm_cols + 1) + 2


def _grid(height: int, width: int, v: VisionConfig) -> ImageGrid:
    rows, cols = height // v.patch_size, width // v.patch_size
    r = v.downsample_ratio
    return ImageGrid(height, width, rows, cols, -(-rows // r), -(-cols // r))


def plan_grid(width: int, height: int, v: VisionConfig) -> ImageGrid:
    """The fitted size of a `width` x `height` image under the config's limits."""
    if width <= 0 or height <= 0:
        raise ImageError(f"image of {width} x {height} pixels: width and height must be positive")
    if v.max_image_tokens < 4:
        raise ImageError(f"vision_config.max_image_tokens {v.max_image_tokens}: an image needs at least 4")
    w: float = width  # fitted size, fractional until rounded to the patch grid
    h: float = height
    if v.max_wh_ratio is not None and width > height * v.max_wh_ratio:
        w = height * v.max_wh_ratio
    if w * h < v.min_pixels:  # scale small images up
        s = math.sqrt(v.min_pixels / (w * h))
        w, h = int(w * s), int(h * s)
    P, cell = v.patch_size, v.patch_size * v.downsample_ratio
    grid = _grid(math.ceil(h / P) * P, math.ceil(w / P) * P, v)
    budget = v.max_image_tokens
    if grid.tokens > budget:
        # rows = aspect * cols and rows * (cols + 1) + 2 = budget, solved for cols
        aspect = h / w
        max_cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
        max_rows = max_cols * aspect
        if max_cols < 1:
            H, W = (budget - 2) // 2 * cell, cell
        elif max_rows < 1:
            H, W = cell, (budget - 3) * cell
        else:
            beta = min(math.floor(max_cols) * cell / w, math.floor(max_rows) * cell / h)
            H, W = math.floor(h * beta / P) * P, math.floor(w * beta / P) * P
        grid = _grid(H, W, v)
    if min(grid.height, grid.width) <= 0 or grid.tokens > budget:
        raise ImageError(f"image of {width} x {height} pixels does not fit vision_config.max_image_tokens {budget}")
    return grid


def _resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    if pixels.shape[:2] == (height, width):
        return pixels
    x = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0).double()  # [1, 3, h, w]
    y = F.interpolate(x, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return y.round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0).numpy()


def fit(pixels: np.ndarray, grid: ImageGrid, v: VisionConfig) -> np.ndarray:
    """uint8 [h, w, 3] -> [grid.height, grid.width, 3]: fitted and centred on grey (or stretched)."""
    h, w = pixels.shape[:2]
    H, W = grid.height, grid.width
    if v.max_wh_ratio is not None and w >= v.max_wh_ratio * h:
        return _resize(pixels, H, W)
    if w * H > W * h:  # wider than the canvas: full width
        size = (max(1, round(h / w * W)), W)
    elif w * H < W * h:
        size = (H, max(1, round(w / h * H)))
    else:
        size = (H, W)
    inner = _resize(pixels, *size)
    if size == (H, W):
        return inner
    out = np.full((H, W, 3), GREY, dtype=np.uint8)
    top, left = round((H - size[0]) / 2), round((W - size[1]) / 2)
    out[top : top + size[0], left : left + size[1]] = inner
    return out


def to_patches(pixels: np.ndarray, grid: ImageGrid, patch: int) -> torch.Tensor:
    """uint8 [H, W, 3] -> float32 [rows * cols, 3, P, P] in [-1, 1], row-major patches."""
    x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float() / 255  # [3, H, W]
    x = (x - 0.5) / 0.5
    x = x.reshape(3, grid.rows, patch, grid.cols, patch).permute(1, 3, 0, 2, 4)
    return x.reshape(grid.rows * grid.cols, 3, patch, patch).contiguous()


def preprocess(pixels: np.ndarray, v: VisionConfig) -> tuple[torch.Tensor, ImageGrid]:
    """uint8 [H, W, 3] RGB -> (patches [rows * cols, 3, P, P] float32, grid)."""
    pixels = _to_rgb(np.asarray(pixels), "image")
    grid = plan_grid(pixels.shape[1], pixels.shape[0], v)
    return to_patches(fit(pixels, grid, v), grid, v.patch_size), grid
