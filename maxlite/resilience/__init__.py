"""Resilience for long runs: the loop's handle is `core.Resilience`, composed of one object per
idea — `clock.Clock` (watchdog, step timer, goodput), `stops.StopVote` (the cross-host stop/save
vote), `snapshot.Snapshots` (in-memory recovery) and `faults.Faults` — plus `preemption`
(signals, Ctrl-C, max_time). How a run ends (exit codes, the restart rule): maxlite/outcome.py. Import the modules themselves; this package
file imports nothing, so no module here imports its own package half-built.
"""
