"""`python -m maxlite.plan [recipe.yml] key=value ... --topology v6e:4x4 [--num-slices N] [--sweep] [--json]`.

Exit status: 0 fits, 1 does not fit (suggestions printed), 2 a mistake in the command or recipe.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from maxlite import cli, config as C
from maxlite.plan import topology as topo_lib


def _parser() -> argparse.ArgumentParser:
    from maxlite.plan import search  # no JAX at import

    p = argparse.ArgumentParser(
        prog="python -m maxlite.plan",
        description="Compile a recipe's train step for a TPU topology on this machine (no TPU needed): "
                    "memory fit, FLOPs, collectives, estimated step time.")
    p.add_argument("recipe", nargs="*", help="[recipe.yml] key=value ... as for python -m maxlite.train")
    p.add_argument("--topology", required=True, help="chip:shape, e.g. v6e:4x4, v5e:2x2, v5p:4x4x4, v4:2x2x1, tpu7x:4x4x4")
    p.add_argument("--num-slices", type=int, default=None, help="multislice: slices joined over DCN "
                   "(default: the recipe's num_slices, else 1)")
    p.add_argument("--sweep", action="store_true", help="rank meshes × remat policies that fit, then "
                   "quantization modes on the fastest")
    p.add_argument("--sweep-remat", default=",".join(search.SWEEP_REMATS),
                   help="remat policies the sweep tries")
    p.add_argument("--sweep-quantization", default=",".join(m for m in search.SWEEP_QUANTIZATIONS if m),
                   help="quantization modes the sweep tries on the fastest mesh × remat ('' for none)")
    p.add_argument("--sweep-pipeline", default=",".join(map(str, search.PIPELINE_STAGES_IN_SLICE)),
                   help="pipeline stages inside a slice the sweep tries (with several slices also one stage per "
                        "slice; '' for no pipeline)")
    p.add_argument("--no-suggest", action="store_true", help="do not search for what would fit")
    p.add_argument("--shardings", action="store_true", help="list every parameter's sharding")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--dump-hlo", default="", metavar="DIR", help="keep XLA's dump of the compiled step in DIR "
                   "(*train_step*after_optimizations.txt: the program whose collectives the estimate reads)")
    return p


def _num_slices(recipe: list[str], flag: int | None) -> int:
    if flag is not None:
        return flag
    cfg = C.load(recipe)
    return cfg.num_slices if cfg.num_slices > 0 else 1


def run(argv: Sequence[str]) -> int:
    opts = _parser().parse_intermixed_args(argv)
    recipe = list(opts.recipe) or ["base.yml"]
    topology = topo_lib.parse(opts.topology, _num_slices(recipe, opts.num_slices))
    topo_lib.require_libtpu()
    topo_lib.quiet_libtpu_env(topology)  # before JAX starts libtpu

    from maxlite.plan import report, search
    from maxlite.plan.compile import compile_plan

    search.stderr_progress(f"compiling {' '.join(recipe)} for {topology.describe()} ...")
    plan = compile_plan(recipe, topology, dump_hlo=opts.dump_hlo)
    suggestions = sweep = None
    if not plan.fits and not opts.no_suggest:
        suggestions = search.suggest(recipe, topology, plan)
    if opts.sweep:
        remats = tuple(r.strip() for r in opts.sweep_remat.split(",") if r.strip())
        modes = ("", *(m.strip() for m in opts.sweep_quantization.split(",") if m.strip()))
        stages = tuple(int(n) for n in opts.sweep_pipeline.split(",") if n.strip())
        sweep = search.sweep(recipe, topology, remats, modes, stages_in_slice=stages)
    if opts.json:
        print(report.to_json(plan, suggestions, sweep))
    else:
        print(report.text(plan, topology.chip, shardings=opts.shardings))
        for lines in (report.suggestion_lines(suggestions or []), report.sweep_lines(sweep or [])):
            if lines:
                print("\n".join(lines))
    return 0 if plan.fits or (sweep and any(r["fits"] for r in sweep)) else 1


@cli.entry_point(topo_lib.TopologyError)
def main(argv: Sequence[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
