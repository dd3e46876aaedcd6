"""`python -m maxlite.launch {slurm,status,cancel}`: the NeMo-style launcher's command line."""

from __future__ import annotations

import argparse
import json
import sys

from maxlite import cli
from maxlite.launch import experiment, slurm, status
from maxlite.launch.experiment import LaunchError


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    p = argparse.ArgumentParser(prog="python -m maxlite.launch", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    parsers = {}

    s = parsers["slurm"] = sub.add_parser("slurm", help="submit a recipe as a Slurm batch job (one task per node)")
    s.add_argument("recipe_args", nargs="+", metavar="RECIPE [key=value ...]",
                   help="what `python -m maxlite.train` gets, e.g. base.yml model_name=tiny steps=100")
    s.add_argument("--experiment-name", "-n", required=True, help="names the job, its directory and run_name")
    s.add_argument("--partition", "-p", required=True, help="Slurm partition (see `sinfo`)")
    s.add_argument("--nodes", "-N", type=int, default=1)
    s.add_argument("--gpus-per-node", type=int, default=0)
    s.add_argument("--ntasks-per-node", type=int, default=1,
                   help="1: one process per node drives all its GPUs (default); G: one process per GPU")
    s.add_argument("--image", "-i", default="", help="container image for pyxis/enroot (docker://... or .sqsh)")
    s.add_argument("--mount", action="append", default=[], metavar="SRC[:DST]", help="extra container mount")
    s.add_argument("--time", "-t", default="", help="time limit, e.g. 04:00:00 (SIGTERM comes --term-grace s before)")
    s.add_argument("--retries", type=int, default=None,
                   help="restarts after a failure (the recipe's max_restarts; preemptions are not counted)")
    s.add_argument("--term-grace", type=int, default=60, help="seconds between SIGTERM and the time limit")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment for the job")
    s.add_argument("--entrypoint", default="maxlite.train", help="module every task runs with `python -m`")
    s.add_argument("--dry-run", action="store_true", help="write and print the script, submit nothing")

    for name, what in (("status", "print the status block of an experiment's latest launch"),
                       ("cancel", "cancel an experiment's latest launch (it will not requeue)")):
        c = parsers[name] = sub.add_parser(name, help=what)
        c.add_argument("name", help="experiment name (--experiment-name at launch)")
        if name == "status":
            c.add_argument("--json", action="store_true", help="print the fields as JSON")
    return p, parsers


@cli.entry_point(LaunchError)
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top, parsers = _parser()
    if not argv or argv[0] not in parsers:
        top.parse_args(argv)  # prints usage and exits 2 (or help)
    # Options may sit among key=value overrides, as users type them: parse the subcommand intermixed.
    args = parsers[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    if args.command == "slurm":
        job = slurm.SlurmJob(
            recipe_args=tuple(args.recipe_args), name=args.experiment_name, partition=args.partition,
            nodes=args.nodes, gpus_per_node=args.gpus_per_node, ntasks_per_node=args.ntasks_per_node,
            image=args.image, mounts=tuple(args.mount), time=args.time, retries=args.retries,
            term_grace=args.term_grace, env=tuple(args.env), entrypoint=args.entrypoint,
        )
        exp_dir = slurm.launch(job, dry_run=args.dry_run)
        if args.dry_run:
            print((exp_dir / "sbatch.sh").read_text())
            print(f"dry run: wrote {exp_dir / 'sbatch.sh'}; nothing submitted")
        else:
            print(status.block(status.collect(exp_dir)))
        return 0
    exp_dir = experiment.latest(args.name)
    if args.command == "cancel":
        job_id = status.cancel(exp_dir)
        print(f"cancelled job {job_id} of {exp_dir.name}")
        return 0
    info = status.collect(exp_dir)
    print(json.dumps(info, indent=2) if args.json else status.block(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
