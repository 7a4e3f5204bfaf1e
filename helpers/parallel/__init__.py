"""The parallel building blocks the lectures take apart: the ring all-reduce (``ring``), DP and
DDP from scratch (``dataparallel``), ZeRO / FSDP (``sharding``), pipeline schedules
(``pipeline``), Megatron's tensor-parallel MLP (``tensor_parallel``); for transformers (lecture
08): a block with its activation memory, tensor and sequence parallelism (``transformer``), ring
attention (``context``), experts over all-to-all (``moe``), a layout on a DeviceMesh and a
planner (``layout``). Built on measure, launcher and workloads; large batches (lecture 05) are
``helpers.optimisation``'s."""
