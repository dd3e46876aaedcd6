"""How much memory this process may still use: the host's, or its container's when that is less.

A container (a Kubernetes pod's `resources.limits.memory`, a Slurm job's cgroup, `docker run -m`)
limits memory through a cgroup while /proc/meminfo still shows the whole machine: a check that
reads only the machine lets the kernel kill the run (exit 137, no line) before its first step. So
the cgroup's limit is read too, v1 (`memory.limit_in_bytes`) and v2 (`memory.max`, "max" meaning
none), at the process's own cgroup and every ancestor up to the hierarchy's root, and the tightest
wins. What a cgroup has left is its limit minus its working set (usage less inactive page cache,
which the kernel reclaims before it kills: Kubernetes counts it the same way).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


@dataclass(frozen=True)
class Memory:
    available: int  # bytes this process can still allocate, about
    limit: int  # the machine's RAM, or the cgroup's limit
    source: str  # "host" or "cgroup v1" / "cgroup v2"
    where: str = ""  # the cgroup file that sets the limit

    def describe(self) -> str:
        gib = 2**30
        if self.source == "host":
            return f"this host has {self.available / gib:,.1f} GiB available"
        return (f"this container's memory limit is {self.limit / gib:,.2f} GiB ({self.source}, {self.where}), "
                f"{self.available / gib:,.2f} GiB of it free")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat(path: str, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _host(proc: str) -> Memory:
    info = {}
    for line in (_read(f"{proc}/meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        if rest.split():
            info[name] = int(rest.split()[0]) * 1024
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Memory(info.get("MemAvailable", total), total, "host")


def _mounts(proc: str) -> list[tuple[str, str, str, str]]:
    """(fstype, root within the hierarchy, mount point, super options) of every cgroup mount."""
    out = []
    for line in (_read(f"{proc}/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((tail[0], fields[3], fields[4], tail[2]))
    return out


def _levels(mount_root: str, mount_point: str, path: str) -> list[str]:
    """The directories of the process's cgroup and its ancestors, innermost first, within the mount."""
    rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path.lstrip("/")
    rel = "" if rel == "." else rel
    here = os.path.normpath(os.path.join(mount_point, rel))
    if not os.path.isdir(here):  # a cgroup namespace shows the process's own cgroup as the root
        here = mount_point
    levels = [here]
    while levels[-1] != os.path.normpath(mount_point) and len(levels) < 64:
        levels.append(os.path.dirname(levels[-1]))
    return levels


def cgroup(proc: str = "/proc") -> Memory | None:
    """The tightest cgroup memory limit over this process's cgroup and its ancestors, or None."""
    v1_path = v2_path = None
    for line in (_read(f"{proc}/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif "memory" in parts[1].split(","):
            v1_path = parts[2]
    best = None
    for fstype, mount_root, mount_point, options in _mounts(proc):
        if fstype == "cgroup" and v1_path is not None and "memory" in options.split(","):
            files, path, version = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"), v1_path, "v1"
        elif fstype == "cgroup2" and v2_path is not None and v1_path is None:
            files, path, version = ("memory.max", "memory.current", "inactive_file"), v2_path, "v2"
        else:
            continue
        for level in _levels(mount_root, mount_point, path):
            raw = (_read(os.path.join(level, files[0])) or "").strip()
            if not raw.isdigit() or int(raw) >= UNLIMITED:
                continue  # "max", absent, or v1's "no limit"
            limit = int(raw)
            usage = int((_read(os.path.join(level, files[1])) or "0").strip() or 0)
            working = max(usage - _stat(os.path.join(level, "memory.stat"), files[2]), 0)
            found = Memory(max(limit - working, 0), limit, f"cgroup {version}", os.path.join(level, files[0]))
            if best is None or found.available < best.available:
                best = found
    return best


def _memory_cgroups(proc: str):
    """(cgroup version, this process's memory cgroup and its ancestors, innermost first)."""
    v1_path = v2_path = None
    for line in (_read(f"{proc}/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif len(parts) == 3 and "memory" in parts[1].split(","):
            v1_path = parts[2]
    for fstype, mount_root, mount_point, options in _mounts(proc):
        if fstype == "cgroup" and v1_path is not None and "memory" in options.split(","):
            yield "v1", _levels(mount_root, mount_point, v1_path)
        elif fstype == "cgroup2" and v2_path is not None and v1_path is None:
            yield "v2", _levels(mount_root, mount_point, v2_path)


_COUNTER = {"v1": "memory.oom_control", "v2": "memory.events"}


def oom_counter(proc: str = "/proc") -> tuple[str, int] | None:
    """(the file that counts this process's cgroup's out-of-memory kills, its count now), or None:
    v2 `memory.events` (its `oom_kill` counts the cgroup's descendants too), v1
    `memory.oom_control`. Whoever finds the process gone compares the count (maxlite/lease.py
    records it when the run starts; `maxlite.status` reads it)."""
    for version, levels in _memory_cgroups(proc):
        path = os.path.join(levels[0], _COUNTER[version])
        if _read(path) is not None:
            return path, oom_kills(path)
    return None


def job_oom_kills(proc: str = "/proc") -> int:
    """Out-of-memory kills in this process's Slurm job cgroup (`job_<id>`, the parent of the batch
    shell's `step_batch`; the job's steps run beside it), 0 outside one: v2 memory.events counts
    the descendants' kills too; v1 counts each cgroup's own, summed here over the job's."""
    for version, levels in _memory_cgroups(proc):
        if len(levels) < 2 or not os.path.basename(levels[1]).startswith("job_"):
            continue
        if version == "v2":
            return oom_kills(os.path.join(levels[1], _COUNTER["v2"]))
        return sum(oom_kills(os.path.join(d, _COUNTER["v1"])) for d, _, files in os.walk(levels[1])
                   if _COUNTER["v1"] in files)
    return 0


def oom_kills(path: str) -> int:
    """The `oom_kill` count of a cgroup's memory.events (v2) or memory.oom_control (v1) file."""
    return _stat(path, "oom_kill")


def memory(proc: str = "/proc") -> Memory:
    """What this process may still allocate: the host's available memory, or its container's
    when that is less."""
    host, limited = _host(proc), cgroup(proc)
    return limited if limited is not None and limited.available < host.available else host
