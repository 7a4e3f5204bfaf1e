#!/usr/bin/env bash
# A two-node Slurm cluster on this machine (course/cluster/), as root:
#   scripts/cluster.sh up            node1 and node2: network namespaces joined by a veth pair,
#                                    cores split by cpuset, munged, slurmctld, a slurmd per node
#   scripts/cluster.sh run CMD...    CMD on the head node (--node node2 before CMD: on node2),
#                                    e.g. `scripts/cluster.sh run sbatch scripts/slurm/torchrun.sbatch`
#   scripts/cluster.sh shape 100     the link between the nodes limited to 100 Mbit/s each way
#                                    (tc tbf on each end of the pair; `shape off` lifts it)
#   scripts/cluster.sh status | down down tears it all down, also after a failed up
# --state DIR before the command picks the cluster's folder (default
# /var/lib/multigpu-course-cluster).
set -euo pipefail
# Debian's slurm-wlm and munge, installed when missing (quick when set up)
COURSE_SETUP_CLUSTER=1 "$(dirname "$0")/setup.sh" >&2
# no cd: `run` keeps the caller's folder, where sbatch puts the job's files
exec "$(dirname "$0")/../.venv/bin/python" -m course.cluster "$@"
