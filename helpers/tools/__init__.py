"""Lecture 07's tools: torchrun agents standing in for nodes (``multinode``) and torch.profiler on
DDP (``profiling``). The top layer beside ``plots``: they use the parallel blocks."""
