"""Every example runs on tiny random models (in-process via runpy, to skip the interpreter start-up), and
`hf-ssd eval --tiny` runs end to end with a verdict."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = ["basic", "streaming", "batch", "sampling_saguaro", "tensor_parallel", "saved_config", "benchmark"]


def test_every_example_is_listed():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_example_runs(name, monkeypatch, capsys):
    monkeypatch.setenv("HF_SSD_TINY", "1")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--tiny", "--max-new-tokens", "12"])
    monkeypatch.syspath_prepend(str(EXAMPLES))
    runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    assert capsys.readouterr().out.strip()


def test_tensor_parallel_example_under_torchrun(tmp_path):
    """The TP example for real: 2 ranks (gloo), target sharded, draft outside the group, same tokens as 1 process."""
    import os
    import shutil
    import subprocess

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun not found next to the interpreter")
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", "29533",
                           str(EXAMPLES / "tensor_parallel.py"), "--tiny"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},
                          cwd=str(EXAMPLES))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: tensor parallel=True" in proc.stdout
    assert proc.stdout.count("identical to a single-process target: True") == 2
    assert not list(tmp_path.glob("hf-ssd-tp-*")), "the example left its saved copies behind"


def test_eval_cli_tiny(tmp_path, capsys):
    import json

    from hf_ssd.tools.cli import main

    out = tmp_path / "report.json"
    rc = main(["eval", "--tiny", "--num-prompts", "1", "--max-new-tokens", "8", "--samples", "16",
               "--sample-tokens", "3", "--output", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["verdict"] == "PASS"
    assert report["fidelity"]["identity_rate"] == 1.0
    assert report["humaneval"]["problems"] == 1 and report["humaneval"]["pass@1_plain"] == report["humaneval"]["pass@1_ssd"]
    assert "verdict: PASS" in capsys.readouterr().out


def test_cli_names_the_tools_extra_when_a_dependency_is_missing(monkeypatch, capsys):
    """`pip install hf-ssd` is the library only: a tool whose dependency is absent says how to get it."""
    from hf_ssd.tools.cli import main

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ModuleNotFoundError
    for name in ("hf_ssd.tools.prompts", "hf_ssd.tools.evaluation.cli"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert main(["eval", "--tiny", "--num-prompts", "1"]) == 1
    err = capsys.readouterr().err
    assert "'datasets' is not installed" in err and 'pip install "hf-ssd[tools]"' in err
