"""A bundle opened for running: its manifest read and checked once, its config parsed once.

Opening validates the manifest (format version, types, cross-references, digests, target and
toolchain) and the layer table against the config it carries; nothing is loaded. What else the
runtime reads of a bundle without loading it is here too: its tokenizer (the copied tokenizer
files, or byte-level), its host-resident vision tower and its compiled draft's description.
Loading it is `runtime/loading.py`.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.bundles import layout, manifest_io
from deepinfer.bundles import manifest as mf
from deepinfer.bundles.layout import MANIFEST_FILE, TOKENIZER_DIR
from deepinfer.bundles.safetensors import load_buffer, load_mmap
from deepinfer.bundles.signatures import check_signature, read_signature
from deepinfer.bundles.verified import Verified, after_verify, open_verified
from deepinfer.regions.config import V41Config, parse_config
from deepinfer.regions.step import DTYPES, plan_layers
from deepinfer.regions.tokenizer import ByteTokenizer, Tokenizer
from deepinfer.runtime.backends import check_compatible


@dataclass(frozen=True)
class Bundle:
    """A bundle opened for running: its path, its manifest (read and checked once) and its model config
    (parsed once)."""

    path: Path
    manifest: mf.Manifest
    config: V41Config
    identity: tuple[int, int] = (0, 0)  # the directory's (device, inode) when it was opened
    # a trusted bundle's files as verified (bundles/verified.py): every later read is of these
    verified: Verified | None = None

    def check_unchanged(self) -> None:
        """Refuse a bundle directory replaced since it was opened (`deepinfer-compile --force` renames
        a new bundle into place): what was loaded would mix two bundles' files."""
        if _identity(self.path) != self.identity:
            raise mf.BundleError(
                f"{self.path}: replaced while it was being loaded (a compile with --force?); "
                "nothing from it is used; run again"
            )


def _identity(path: Path) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1)
    return (st.st_dev, st.st_ino)


def open_bundle(path: str | Path, *, verify: bool = True, trust=None, rank: int | None = None) -> Bundle:
    """Read and check a bundle's manifest (format version first, types, cross-references), its files
    (present; digests unless `verify` is off) and that this process can run it; parse its config.
    With `trust` (an Ed25519 public key, `bundles.signing.load_public_key`), the manifest must carry a
    signature by that key, checked before anything else is read, and the files this process uses
    (`rank`'s, every rank's without one: `files_for_rank`) are verified as they are streamed to
    where they are used (bundles/verified.py). Loading checks at its end that the directory is still
    the one opened here."""
    path = Path(path)
    if trust is not None and not verify:
        raise mf.BundleError(
            f"{path}: a trusted key needs the digest check (the signature covers the files "
            "through their digests); drop --no-verify"
        )
    identity = _identity(path)
    manifest = manifest_io.read(path, trust=trust)
    manifest_io.check_files(path, manifest, digests=verify and trust is None)
    verified = None if trust is None else open_verified(path, files_for_rank(manifest, rank), mf.BundleError)
    check_compatible(manifest, path)
    config = parse_config(manifest.model.config, str(path / MANIFEST_FILE))
    bundle = Bundle(path, manifest, config, identity, verified)
    check_layers(bundle)
    bundle.check_unchanged()
    after_verify(path)  # a test hook: nothing runs it unless a test sets it
    return bundle


def files_for_rank(manifest: mf.Manifest, rank: int | None) -> dict[str, str]:
    """The files (rel path -> digest) a process loading `rank` reads: all of them but the other ranks'
    own weight files (every file for `rank` None)."""
    if rank is None:
        return dict(manifest.files)
    mine = {f for w in manifest.weights.get(layout.rank_key(rank), ()) for f in w.files}
    others = {f for ws in manifest.weights.values() for w in ws for f in w.files} - mine
    return {rel: digest for rel, digest in manifest.files.items() if rel not in others}


LAYER_FIELDS = ("attn", "ratio", "kv_source", "candidate_source", "uses_candidates")


def check_layers(bundle: Bundle) -> None:
    """The manifest's layer table against the model config it carries: each layer's attention
    role as the config's schedule gives it, and each (kind, index) binding the layer's place among
    the layers of that kind (stacks are layer-major in layer order). A table edited by hand (two
    layers' weights swapped, a layer's kind changed) is refused before anything is loaded."""
    where = bundle.path / MANIFEST_FILE
    m = bundle.manifest
    want = plan_layers(bundle.config.text)
    if [l.layer for l in m.layers] != [p.layer for p in want]:
        raise mf.BundleError(
            f"{where}: layers lists {[l.layer for l in m.layers]}, the model config has {len(want)} layers"
        )
    seen: dict[str, int] = defaultdict(int)
    for i, (l, p) in enumerate(zip(m.layers, want)):
        for name in LAYER_FIELDS:
            if getattr(l, name) != getattr(p, name):
                raise mf.BundleError(
                    f"{where}: layers[{i}].{name} is {getattr(l, name)!r}; the model config "
                    f"gives layer {p.layer} {getattr(p, name)!r}"
                )
        if l.engram != bool(p.engram_rows):
            raise mf.BundleError(
                f"{where}: layers[{i}].engram is {l.engram}; the model config gives layer "
                f"{p.layer} {bool(p.engram_rows)}"
            )
        for slot, b in l.regions.items():
            if b.index != seen[b.kind]:
                raise mf.BundleError(
                    f"{where}: layers[{i}].regions.{slot}.index is {b.index}; layer {p.layer} is "
                    f"number {seen[b.kind]} of kind {b.kind} in layer order"
                )
            seen[b.kind] += 1


def require_draft(bundle: Bundle) -> mf.Draft:
    """The bundle's compiled draft; a BundleError in one line for a bundle compiled without one."""
    if bundle.manifest.draft is None:
        raise mf.BundleError(
            f"{bundle.path}: compiled without a speculative draft, so it cannot run --speculative "
            'dspark; add [speculative] draft = "dspark" to its model.toml and compile again'
        )
    return bundle.manifest.draft


def stack_tensors(bundle: Bundle | Path, entry: mf.WeightStack) -> dict[str, torch.Tensor]:
    """A kind's stacks on one rank, memory-mapped: its own file's and those every rank shares."""
    out = {}
    for rel in entry.files:
        out.update(tensors(bundle, rel))
    return out


def tensors(bundle: Bundle | Path, rel: str) -> dict:
    """The tensors of the bundle's safetensors file `rel`: views of its verified bytes (those whose
    digest was checked, held in memory) for a trusted bundle, else of a memory map of the file."""
    if isinstance(bundle, Bundle) and bundle.verified is not None:
        return load_buffer(bundle.verified.data(rel), str(bundle.path / rel))
    return load_mmap(Path(bundle.path if isinstance(bundle, Bundle) else bundle) / rel)


@contextlib.contextmanager
def executable_file(bundle: Bundle, rel: str) -> Iterator[Path]:
    """A path a loader may open for the executable `rel`: for a trusted bundle, a private copy of its
    verified bytes (removed when the block ends), else the bundle's file."""
    if bundle.verified is None:
        yield bundle.path / rel
    else:
        with bundle.verified.private_copy(rel) as path:
            yield path


def check_executables(bundle: Bundle) -> None:
    """Each executable's own signature (read from its file, bundles/signatures.py) against its manifest
    entry, before any program is loaded: a swapped executable is refused in one line naming it."""
    from deepinfer.reader import open_regular

    for e in bundle.manifest.regions:
        where = str(bundle.path / e.artifact)
        if bundle.verified is not None:
            with bundle.verified.open(e.artifact) as f:
                sig = read_signature(f, e.executable, where)
        else:
            fd = open_regular(bundle.path / e.artifact, 16 << 30, root=bundle.path, error=mf.BundleError)
            with os.fdopen(fd, "rb") as f:
                sig = read_signature(f, e.executable, where)
        if sig is not None:
            check_signature(e, sig, where)


def load_vision(bundle: Bundle):
    """A bundle's host-resident vision tower and aligner (regions.vision, imported only here)."""
    from deepinfer.regions.vision import VisionTower, tensor_getter

    host = bundle.manifest.host.get("vision")
    if host is None:
        raise mf.BundleError(
            f"{bundle.path}: the bundle has no vision tower (its checkpoint's "
            "vision_config.num_hidden_layers is 0); it cannot take images"
        )
    path = bundle.path / host.path
    return VisionTower(
        bundle.config,
        tensor_getter(tensors(bundle, host.path), str(path)),
        DTYPES[bundle.manifest.model.dtype],
        str(bundle.path / MANIFEST_FILE),
    )


def tokenizer(bundle: Bundle) -> Tokenizer:
    """The tokenizer a bundle records: its copied tokenizer files (`tokenizer/`), or byte-level with
    the ids of its config."""
    m = bundle.manifest
    if m.model.tokenizer == "byte":
        c = bundle.config
        return ByteTokenizer(c.bos_token_id, c.eos_token_id, c.pad_token_id)
    from deepinfer.regions.hf_tokenizer import TokenizersTokenizer

    if bundle.verified is None:
        return TokenizersTokenizer.from_dir(bundle.path / TOKENIZER_DIR)
    with bundle.verified.private_dir(TOKENIZER_DIR) as directory:  # the verified files, not the bundle's
        tok = TokenizersTokenizer.from_dir(directory)
    tok.source = bundle.path / TOKENIZER_DIR  # errors name the bundle's files
    return tok
