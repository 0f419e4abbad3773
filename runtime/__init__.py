"""deepinfer.runtime: load a bundle and generate with it (`deepinfer-run`)."""

from deepinfer.runtime.session import Session, load

__all__ = ["Session", "load"]
