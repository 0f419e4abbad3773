"""What a trusted load holds beside a plain one (issue 44 item 3), for bench/reliability.py's `rss` surface.

    measured  the tiny bundle loaded (`runtime.loading.load`) in a fresh process of its own, plainly and
              under --trust (the bundle copied and signed with a fresh key), `REPEATS` times each: the
              best (lowest) peak RSS (VmHWM) of each, and `trusted_over_plain_peak_rss`, their ratio.
    modelled  at the release (examples/release/model.toml, planned without tracing: `plan_bundle`), the
              bytes one rank holds in private memory while it loads under --trust: before, every file of
              the bundle (each rank read all of them, every rank's weights included, into anonymous
              memory); now, its own weight files, the shared ones and the host files (tensors over the
              bytes it hashed), plus one streaming buffer; executables are streamed to files (the plan
              does not know their sizes: not counted in either). A plain host load maps the same files.

`python bench/reliability_rss.py --child BUNDLE [PUBKEY]` is the measured process.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, answer, run_child, status_kib

REPEATS = 3  # fresh processes per kind; the lowest peak of each is compared (a peak only grows with noise)
RANKS = 64  # the release's ranks (ep = cp = 64)


def child(bundle: str, public: str | None) -> None:
    """Load `bundle` as rank 0 (under --trust with the key at `public`) and answer with the peak RSS."""
    base = status_kib("VmRSS")
    from deepinfer.bundles.signing import load_public_key
    from deepinfer.runtime.bundle import open_bundle
    from deepinfer.runtime.loading import load

    trust = None if public is None else load_public_key(public)
    executor = load(open_bundle(bundle, trust=trust, rank=0))
    answer({"peak_kib": status_kib("VmHWM"), "weights": len(executor.bound)}, base)


def measured(bundle: Path, work: Path) -> dict:
    """Peak RSS of a plain and a trusted load of `bundle` (KiB, the lowest of REPEATS fresh processes)."""
    from deepinfer.bundles import layout
    from deepinfer.bundles.signing import keygen, load_private_key, sign_file

    signed = work / "signed"
    shutil.rmtree(signed, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    shutil.copytree(bundle, signed)
    keygen(work / "rss.pem", work / "rss.pem.pub")
    sign_file(signed / layout.MANIFEST_FILE, load_private_key(work / "rss.pem"), signed / layout.SIGNATURE_FILE)
    script = str(Path(__file__).resolve())
    plain, trusted = [], []
    for _ in range(REPEATS):  # interleaved: a machine that gets busier weighs on both alike
        plain.append(run_child(script, "--child", str(signed))["peak_kib"])
        trusted.append(run_child(script, "--child", str(signed), str(work / "rss.pem.pub"))["peak_kib"])
    return {
        "plain_peak_kib": min(plain),
        "trusted_peak_kib": min(trusted),
        "trusted_over_plain_peak_rss": round(min(trusted) / min(plain), 3),
    }


def release_model() -> dict:
    """Bytes a release rank holds in private memory while it loads under --trust, before and now."""
    from deepinfer.bundles.verified import CHUNK_BYTES
    from deepinfer.compiler.bundle_plan import plan_bundle
    from deepinfer.compiler.config import load_compile_config

    plan = plan_bundle(load_compile_config(ROOT / "examples" / "release" / "model.toml"), scratch=False)
    weights = {f for files in plan.rank_files.values() for f in files} | set(plan.shared_files)
    host = sum(n for f, n in plan.files.items() if f not in weights)
    rank = next(iter(plan.rank_files))
    before = sum(plan.files.values())
    now = plan.rank_file_bytes(rank) + host + CHUNK_BYTES
    return {
        "ranks": len(plan.rank_files),
        "rank_weight_bytes": plan.rank_file_bytes(rank),
        "host_file_bytes": host,
        "bundle_file_bytes": before,
        "before_bytes_per_rank": before,
        "now_bytes_per_rank": now,
        "before_bytes_all_ranks": before * len(plan.rank_files),
        "now_bytes_all_ranks": now * len(plan.rank_files),
    }


def table(m: dict, release: dict) -> str:
    """The figures as the bench prints them."""
    gib, ranks = 2**30, f"{release['ranks']} ranks"
    return "\n".join(
        [
            f"\n{'trusted load':<34} {'plain':>12} {'trusted':>12} {'ratio':>7}",
            f"{'tiny bundle, peak RSS (MiB)':<34} {m['plain_peak_kib'] / 1024:>12.1f} "
            f"{m['trusted_peak_kib'] / 1024:>12.1f} {m['trusted_over_plain_peak_rss']:>7.3f}",
            f"\n{'release, held while loading (GiB)':<34} {'before':>12} {'now':>12}",
            f"{'one rank':<34} {release['before_bytes_per_rank'] / gib:>12.1f} "
            f"{release['now_bytes_per_rank'] / gib:>12.1f}",
            f"{ranks:<34} {release['before_bytes_all_ranks'] / gib:>12.1f} "
            f"{release['now_bytes_all_ranks'] / gib:>12.1f}",
            f"  (a rank's weight files {release['rank_weight_bytes'] / gib:.2f} GiB, host files "
            f"{release['host_file_bytes'] / gib:.2f} GiB, the whole bundle's files {release['bundle_file_bytes'] / gib:.1f} GiB)",
        ]
    )


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    child(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
