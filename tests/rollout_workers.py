"""Rollout workers that misbehave, for tests/test_rollout_actors.py (importable by the Ray actors:
they run in the repository's directory). Each is a RolloutWorker with a hook in generate."""

import os
import time

from maxlite.rollout.actors import RolloutWorker


class HoldsInGenerate(RolloutWorker):
    """Writes `<hold_dir>/<pid>.started` in generate, then waits for `<hold_dir>/go` before sampling,
    so a test can kill the worker inside generate."""

    def __init__(self, cfg, hold_dir: str):
        super().__init__(cfg)
        self.hold_dir = hold_dir

    def generate(self, *args):
        open(os.path.join(self.hold_dir, f"{os.getpid()}.started"), "w").close()
        while not os.path.exists(os.path.join(self.hold_dir, "go")):
            time.sleep(0.05)
        return super().generate(*args)


class HangsOnce(RolloutWorker):
    """The first generate among the workers sharing `marker_dir` never answers: it writes its pid to
    `<marker_dir>/hung` (created exclusively: one worker only) and sleeps until killed."""

    def __init__(self, cfg, marker_dir: str):
        super().__init__(cfg)
        self.marker = os.path.join(marker_dir, "hung")

    def generate(self, *args):
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return super().generate(*args)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        while True:
            time.sleep(3600)
