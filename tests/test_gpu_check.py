"""The GPU check (tools/gpu_check.py): its smoke run passes every step while the packages the
GPU image lacks cannot be imported, and its full steps fit the GPU slot."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tools import gpu_check

ROOT = Path(__file__).resolve().parents[1]
# Installed here for the server and the test suite; the GPU image has none of them.
ABSENT_ON_GPU_IMAGE = ["fastapi", "uvicorn", "starlette", "openai", "scipy", "hypothesis",
                       "matplotlib", "torch", "transformers"]
# Loaded by every Python process that has its folder on PYTHONPATH (the check's steps inherit
# it): importing any of those packages then fails as if it were not installed.
BLOCKER = f'''import sys

ABSENT = {set(ABSENT_ON_GPU_IMAGE)!r}


class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Absent())
'''


def test_full_steps_fit_the_gpu_slot(tmp_path):
    plan = gpu_check.steps(smoke=False, out=tmp_path)
    assert sum(s.limit for s in plan) <= gpu_check.TOTAL_S - gpu_check.RESERVE_S
    assert gpu_check.TOTAL_S <= 480
    assert [s.name for s in plan] == [s.name for s in gpu_check.steps(smoke=True, out=tmp_path)]


def test_a_step_cut_off_keeps_what_it_printed(tmp_path):
    slow = gpu_check.Step("slow", "a step past its limit", 1, [
        sys.executable, "-c", "import time; print('| row |', flush=True); time.sleep(60)"])
    t0 = time.monotonic()
    status, seconds = gpu_check.run(slow, tmp_path, 1, dict(os.environ))
    assert status == "timed out at 1 s" and time.monotonic() - t0 < 30
    table = (tmp_path / "slow.md").read_text()
    assert "| row |" in table and "timed out" in table


def test_the_check_stops_within_its_budget(tmp_path, monkeypatch):
    """Three 4 s steps in a 6 s budget: the first runs its 4 s, the second is cut to the
    2 s left, the third is skipped."""
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(gpu_check, "steps", lambda smoke, out: [
        gpu_check.Step(name, name, 4, sleep) for name in ("a", "b", "c")])
    monkeypatch.setattr(gpu_check, "TOTAL_S", 7)
    monkeypatch.setattr(gpu_check, "RESERVE_S", 1)
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1)
    t0 = time.monotonic()
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    assert time.monotonic() - t0 < 7
    rows = [line for line in (tmp_path / "summary.md").read_text().splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert "timed out at 4 s" in rows[0]
    assert re.search(r"timed out at [12] s", rows[1]) and "skipped" in rows[2]


def test_smoke_run_without_the_packages_the_gpu_image_lacks(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=str(blocker))
    for name in ABSENT_ON_GPU_IMAGE:  # the blocker works, in a process like the steps'
        r = subprocess.run([sys.executable, "-c", f"import {name}"], env=env,
                           capture_output=True, text=True)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, name
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--smoke", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("*.log")))
    assert r.returncode == 0, r.stdout + r.stderr + logs
    summary = (out / "summary.md").read_text()
    status = {cells[2].split(":")[0].strip(): cells[4].strip()
              for cells in (line.split("|") for line in summary.splitlines())
              if len(cells) > 4 and cells[1].strip().isdigit()}
    plan = gpu_check.steps(smoke=True, out=out)
    assert status == {step.name: "ok" for step in plan}, summary
    for step in plan:
        tables = [f"{step.name}.md"] + ([f"{step.name}.json"] if step.json else [])
        for name in tables:
            assert (out / name).stat().st_size > 0, name
        assert "|---|" in (out / f"{step.name}.md").read_text(), step.name
