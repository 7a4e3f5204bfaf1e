"""One-call plots of the course's measurements, one module per chapter. Each returns the
matplotlib Axes it drew on; every function is importable from here (``helpers.plots.speedup``).

Times in seconds, sizes in bytes, bandwidth in GB/s (1 GB = 1e9 bytes), as everywhere.
"""

from helpers.plots.collectives import alpha_beta, busbw, collective, ring
from helpers.plots.data_parallel import comm_bars, overlap, predicted_vs_measured, speedup, timeline
from helpers.plots.large_batch import batch_accuracy, critical_batch, sharpness
from helpers.plots.memory import MEMORY_COLORS, heatmap, memory_per_rank, memory_phases, zero_stages
from helpers.plots.model_parallel import PIPELINE_COLORS, mesh, pipeline, strategies
from helpers.plots.setup import device_model
from helpers.plots.tools import profile_timeline
from helpers.plots.transformers import activation_parts, attention_work

__all__ = [
    "device_model",
    "collective",
    "ring",
    "alpha_beta",
    "busbw",
    "speedup",
    "comm_bars",
    "overlap",
    "timeline",
    "predicted_vs_measured",
    "MEMORY_COLORS",
    "memory_phases",
    "zero_stages",
    "memory_per_rank",
    "heatmap",
    "PIPELINE_COLORS",
    "pipeline",
    "strategies",
    "mesh",
    "batch_accuracy",
    "critical_batch",
    "sharpness",
    "profile_timeline",
    "activation_parts",
    "attention_work",
]
