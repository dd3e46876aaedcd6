"""Resilience for long runs: the loop's handle is `core.Resilience`, composed of one object per
idea — `clock.Clock` (watchdog, step timer, goodput), `stops.StopVote` (the cross-host stop/save
vote), `snapshot.Snapshots` (in-memory recovery) and `faults.Faults` — plus `exit_codes` (THE
restart rule) and `preemption` (signals, max_time). Import the modules themselves; this package
file imports nothing, so no module here imports its own package half-built.
"""
