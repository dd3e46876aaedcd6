"""Launchers. Slurm, NeMo-style: `python -m maxlite.launch slurm|status|cancel` (docs/slurm.md)."""
