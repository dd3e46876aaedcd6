import json
import os

from maxlite import config as C
from maxlite.status import main, run_status
from maxlite.train import train
from tests.helpers import SMALL



def test_status_of_a_finished_then_running_run(tmp_path, capsys):
    cfg = C.load([*SMALL, "steps=4", "checkpoint_period=3", "run_name=st", f"base_output_directory={tmp_path}"])
    train(cfg)
    run_dir = f"{tmp_path}/st"
    records = [json.loads(l) for l in open(f"{run_dir}/metrics.jsonl")]
    last = [r for r in records if "loss" in r][-1]
    saved = sorted(int(d) for d in os.listdir(f"{run_dir}/checkpoints") if d.isdigit())
    st = run_status(run_dir)
    assert st["state"] == "finished" and st["step"] == 4 and st["steps"] == 4
    assert st["loss"] == last["loss"]
    assert st["tokens_per_second_per_device"] == last["tokens_per_second_per_device"]
    assert st["last_checkpoint"] == saved[-1]
    assert st["goodput"] == [r for r in records if "summary" in r][-1]["summary"]["goodput"]
    assert "eta_seconds" not in st
    # The same directory seen mid-run: 10 steps asked, 4 done → ETA from the mean step time.
    open(f"{run_dir}/config.yml", "a").write("\nsteps: 10\n")
    json.dump({"state": "running", "step": 4}, open(f"{run_dir}/status.json", "w"))
    secs = [r["seconds"] for r in records if "loss" in r]
    assert abs(run_status(run_dir)["eta_seconds"] - 6 * sum(secs) / len(secs)) < 1e-9
    assert main([run_dir]) == 0
    assert "state: running" in capsys.readouterr().out


def test_not_a_run_directory_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("maxlite: error:") and "not a maxlite run directory" in err and "\n" not in err


def test_a_run_whose_process_died_is_named_lost_under_the_plain_cli(tmp_path):
    """`python -m maxlite.train` with no launcher: a process that dies without a word (an injected
    crash, exit 1, no traceback) leaves status.json at `running`; `maxlite.status` names it lost,
    and why, from its lease."""
    from tests.helpers import run_module

    codes, outs = run_module("maxlite.train", [*SMALL, "steps=6", "fault_type=crash", "fault_step=2",
                                               "run_name=c", f"base_output_directory={tmp_path}"], devices=1)
    assert codes == [1] and "Traceback" not in outs[0], outs[0][-3000:]
    st = run_status(f"{tmp_path}/c")
    assert st["state"] == "lost" and "its process is gone" in st["lost"] and "run it again" in st["lost"], st
