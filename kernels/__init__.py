"""deepinfer.kernels: custom ops (torch.library) used by the regions.

Importing this package registers every op under `torch.ops.deepinfer`.
`KERNELS` maps each op's name to its reference and source file.
"""

from deepinfer.kernels import attention, hc, index_select, linear, norm, select  # noqa: F401  (registers the ops)
from deepinfer.kernels.registry import KERNELS, reference_decompositions, target_decompositions

__all__ = ["KERNELS", "reference_decompositions", "target_decompositions"]
