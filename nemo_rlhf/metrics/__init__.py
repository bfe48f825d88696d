"""Metrics sinks: TensorBoard scalars, a concise console line, a progress bar."""

from nemo_rlhf.metrics.logger import MetricsLogger

__all__ = ["MetricsLogger"]
