"""Plan before you pay: compile a recipe's real train step for a TPU topology on any machine.

`python -m maxlite.plan base.yml model_name=llama3-8b ... --topology v6e:4x4` reports whether it
fits, per-device HBM, FLOPs, collectives and an estimated step time; `--sweep` ranks meshes × remat
policies. Modules: topology (chips, names, AOT devices), compile (the real step → numbers), hlo
(collectives), estimate (roofline step time), search (suggestions, sweep), report (text, JSON).
"""
