"""``python -m helpers.run module:function [args] --out results.pkl``: the command torchrun (or
Slurm's srun) starts on every node. The code lives in helpers/launcher/run.py; this file keeps
the command's name short and stable."""

from helpers.launcher.run import exit_now, main, parse_call, parse_value, resolve

__all__ = ["exit_now", "main", "parse_call", "parse_value", "resolve"]

if __name__ == "__main__":
    exit_now(main())
