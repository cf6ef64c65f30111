"""Pre-flight estimates of per-GPU memory and step time for a Layout (plain Python, no torch).

``estimate(model, layout, cluster, seq_length)`` is the library call (``stage_memory`` gives the allocated
memory of every pipeline stage); ``Calibration`` refines it from measured trials. Nothing here imports torch,
ray or megatron: ``plan`` must stay instant.
"""

from sweeper.config.estimator import EstimatorConstants
from sweeper.estimate.calibration import Calibration
from sweeper.estimate.estimator import Estimate, Estimator, StageMemory, estimate, stage_memory

__all__ = ["Calibration", "Estimate", "Estimator", "EstimatorConstants", "StageMemory", "estimate", "stage_memory"]
