"""Measuring: time (``timing``, ``tracing``, ``scaling``), bytes and bandwidth (``comm``,
``bandwidth``, ``bench``), memory (``memory``), the cost model (``costmodel``), what a backend
supports (``probe``), torchvision's models timed per step (``zoo``), and what the samples allow
one to say (``findings``). Imports the launcher and the workloads, never the parallel blocks."""
