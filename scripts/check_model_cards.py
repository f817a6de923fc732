"""Check every model card in model_cards/: YAML metadata (library_name, tags, base_model, ssd block), a loadable
ssd_config.json, a Usage and a Results section with the results markers, and no numbers in an unmeasured results
table. `--fill` first writes the results table of each measured card from `hf-ssd bench` JSON in benchmarks/.

    python scripts/check_model_cards.py [--fill] [--cards model_cards] [--benchmarks benchmarks]
Exit code 0 when every card is valid; the problems are printed otherwise.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- hf_ssd:results:start -->", "<!-- hf_ssd:results:end -->"
REQUIRED_TAGS = {"speculative-decoding", "ssd", "hf_ssd"}
HEADER = ("| setting | T | batch | method | tok/s (decode) | speedup vs plain | tokens/round | hit rate | greedy identical |\n"
          "|---|---|---|---|---|---|---|---|---|")


def _metadata(readme: Path) -> dict:
    from huggingface_hub import ModelCard

    return ModelCard.load(readme, ignore_metadata_errors=False).data.to_dict()


def check_card(card_dir: Path) -> list[str]:
    from hf_ssd.hf.hub import from_pretrained

    errs: list[str] = []
    readme, cfg = card_dir / "README.md", card_dir / "ssd_config.json"
    if not readme.is_file():
        return [f"{card_dir.name}: README.md missing"]
    text = readme.read_text()
    if not text.startswith("---\n"):
        errs.append(f"{card_dir.name}: README.md does not start with YAML metadata (---)")
    try:
        meta = _metadata(readme)
    except Exception as e:  # noqa: BLE001 - any YAML problem is a card problem
        return errs + [f"{card_dir.name}: YAML metadata unreadable: {e}"]
    if meta.get("library_name") != "transformers":
        errs.append(f"{card_dir.name}: library_name must be 'transformers', got {meta.get('library_name')!r}")
    tags = set(meta.get("tags") or [])
    if not REQUIRED_TAGS <= tags:
        errs.append(f"{card_dir.name}: tags must include {sorted(REQUIRED_TAGS - tags)}")
    base = meta.get("base_model")
    base = [base] if isinstance(base, str) else base
    if not base or not all(isinstance(b, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", b) for b in base):
        errs.append(f"{card_dir.name}: base_model must list Hub repo ids (owner/name), got {base!r}")
    ssd = meta.get("ssd") or {}
    if not isinstance(ssd.get("measured_by_us"), bool):
        errs.append(f"{card_dir.name}: metadata ssd.measured_by_us must be true or false")
    if base and ssd and [ssd.get("target"), ssd.get("draft")] != list(base)[:2]:
        errs.append(f"{card_dir.name}: ssd.target/ssd.draft must equal base_model [target, draft]")
    if not cfg.is_file():
        errs.append(f"{card_dir.name}: ssd_config.json missing")
    else:
        try:
            from_pretrained(cfg)
        except Exception as e:  # noqa: BLE001
            errs.append(f"{card_dir.name}: ssd_config.json invalid: {e}")
    for section in ("## Usage", "## Results"):
        if section not in text:
            errs.append(f"{card_dir.name}: section {section!r} missing")
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        errs.append(f"{card_dir.name}: results markers {START} ... {END} missing or misplaced")
    else:
        table = text[text.index(START):text.index(END)]
        placeholder = "Placeholder" in table
        if ssd.get("measured_by_us") is False:
            if "not measured by us" not in text.lower():
                errs.append(f"{card_dir.name}: an unmeasured card must say 'not measured by us'")
            if not placeholder:
                errs.append(f"{card_dir.name}: results table of an unmeasured card must stay a placeholder")
        if not placeholder and "`hf-ssd" not in table and "command" not in table.lower():
            errs.append(f"{card_dir.name}: measured results must name the command that produced them")
        if placeholder and re.search(r"\|\s*\d", table):
            errs.append(f"{card_dir.name}: placeholder results table contains numbers")
    return errs


def _fmt(v, nd=2):
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def results_table(reports: list[tuple[Path, dict]]) -> str:
    parts = []
    for path, rep in reports:
        rows = [HEADER]
        for r in rep.get("results", []):
            rows.append("| " + " | ".join([
                str(r.get("setting")), _fmt(r.get("temperature"), 1), str(r.get("batch_size")), str(r.get("method")),
                _fmt(r.get("tokens_per_s_decode")), _fmt(r.get("speedup_vs_plain")),
                _fmt(r.get("mean_tokens_per_round")), _fmt(r.get("hit_rate")), _fmt(r.get("greedy_equal")),
            ]) + " |")
        machine = rep.get("machine", {})
        parts.append(f"Measured by hf_ssd ({rep.get('created', '?')}, `{path.name}`, machine: "
                     f"{_machine_text(machine)}). Command:\n\n"
                     f"```\n{rep.get('command')}\n```\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


def _machine_text(machine: dict) -> str:
    cpu = machine.get("cpu_model") or machine.get("cpu") or machine.get("device") or machine.get("processor") or "?"
    cores = f", {machine['cpu_count']} cores" if machine.get("cpu_count") else ""
    mem = f", {machine['mem_total_gb']} GB" if machine.get("mem_total_gb") else ""
    return f"{cpu}{cores}{mem}"


def fill(cards: Path, benchmarks: Path) -> list[str]:
    """Write measured cards' results from matching bench reports; returns the cards filled."""
    done = []
    reports = []
    for p in sorted(benchmarks.glob("**/*.json")) if benchmarks.is_dir() else []:
        try:
            rep = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rep, dict) and "results" in rep and "command" in rep:
            reports.append((p, rep))
    for card in sorted(d for d in cards.iterdir() if d.is_dir()):
        readme = card / "README.md"
        meta = _metadata(readme)
        ssd = meta.get("ssd") or {}
        match = ssd.get("bench_match")
        if not ssd.get("measured_by_us") or not match:
            continue
        mine = [(p, r) for p, r in reports if match in json.dumps(r.get("models", {}))]
        if not mine:
            continue
        text = readme.read_text()
        new = text[:text.index(START) + len(START)] + "\n" + results_table(mine) + "\n" + text[text.index(END):]
        readme.write_text(new)
        done.append(card.name)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cards", type=Path, default=ROOT / "model_cards")
    p.add_argument("--benchmarks", type=Path, default=ROOT / "benchmarks")
    p.add_argument("--fill", action="store_true", help="fill measured cards' results from benchmarks/ JSON first")
    args = p.parse_args(argv)
    if args.fill:
        print("filled:", ", ".join(fill(args.cards, args.benchmarks)) or "nothing (no matching benchmark JSON)")
    cards = sorted(d for d in args.cards.iterdir() if d.is_dir())
    errs = [e for d in cards for e in check_card(d)]
    if not cards:
        errs.append(f"no model cards in {args.cards}")
    for e in errs:
        print("ERROR", e)
    print(f"{len(cards)} card(s) checked, {len(errs)} problem(s)")
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
