"""Training at a large batch (lecture 05, lab 05): optimisation, not parallelism.

A global batch on any number of ranks, by gradient accumulation, epochs at any batch with a
schedule and an optimizer (``large_batch``); the gradient noise scale and the critical batch
(``noise_scale``); how large a step may be, sharpness and trust ratios (``stability``).

Layer 2, beside ``parallel``: it may import measure, launcher and workloads, and neither imports
the other.
"""
