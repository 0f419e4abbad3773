"""deepinfer.runtime: load a bundle and generate with it (`deepinfer-run`).

Depends only on the bundle format (deepinfer.bundles), the shared step of the
model family (deepinfer.regions.step, .generate, .spans) and its own backends:
never on the compiler or a region class (tests/test_layers.py holds it to that).
"""

from deepinfer.runtime.session import Bundle, Session, load, open_bundle

__all__ = ["Bundle", "Session", "load", "open_bundle"]
