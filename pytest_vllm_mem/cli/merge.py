"""`python -m pytest_vllm_mem merge OUT SHARD...`: one run's files from the files of its shards (--vllm-shard=K/N).

Each SHARD is a folder (a CI job's artifact: its results JSON, baseline file and calibration.json wherever the run
put them) or a file. Files are recognised by content, not name, and matched by their path inside each folder:
`shard-1/results/24gb.json` and `shard-2/results/24gb.json` become `OUT/results/24gb.json`. Other files (logs,
plots, markdown) are left out. With files for SHARDs, OUT is the one file they merge into.

- Results: the tests' records are concatenated, sorted by test id (a test in two shards is an error: the shards
  overlap), and the summary is recomputed from the records' raw per-request samples (baseline/summary.py), so its
  percentiles are those one unsharded run over the same requests reports, not an average of the shards' percentiles.
- Baseline files and calibrations, entry by entry, against what OUT already holds (the repository's file the shards
  started from, or nothing): an entry no shard changed stays; one that shards changed (written, refreshed, pruned)
  takes their value; two shards that changed the same entry differently are an error naming both files. Written
  atomically under the file's lock, as the plugin writes them.

Exit 0 when merged, 1 when the files disagree or cannot be read (nothing of that file is written), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, TypeVar

import filelock

from pytest_vllm_mem.baseline.store import BaselineEntry, BaselineError, BaselineStore
from pytest_vllm_mem.baseline.summary import dumps_results, results_summary
from pytest_vllm_mem.plan.calibration import FORMAT_VERSION

EXIT_MERGED, EXIT_CONFLICT, EXIT_USAGE = 0, 1, 2

FileKind = Literal["results", "baseline", "calibration"]
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class MergeError(Exception):
    """The shards' files cannot be merged: one paragraph naming the files and the entry."""


@dataclass(frozen=True)
class Source:
    """One shard's file: where it is, what it holds, its parsed JSON."""

    path: Path
    kind: FileKind
    document: dict[str, Any]


def classify(document: object) -> FileKind | None:
    """What a JSON document is: the plugin's results file, a baseline file, calibration.json, or none of them."""
    if not isinstance(document, dict):
        return None
    if "schema" in document and isinstance(document.get("tests"), list):
        return "results"
    if "schema" in document and "baselines" in document:
        return "baseline"
    if "format" in document and "entries" in document:
        return "calibration"
    return None


def read_source(path: Path) -> Source | None:
    """The file as a Source; None when it is not one of the three kinds (any JSON of the user's, a log)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise MergeError(f"{path}: cannot be read ({error}).") from None
    except json.JSONDecodeError as error:
        if path.suffix != ".json":
            return None
        raise MergeError(
            f"{path}: not valid JSON ({error.msg} at line {error.lineno}); a shard's file was cut short? Upload it "
            "again or leave that shard's folder out."
        ) from None
    kind = classify(document)
    return None if kind is None else Source(path, kind, document)


def gather(shards: Sequence[Path]) -> tuple[dict[Path, list[Source]], int]:
    """Every recognised file of the SHARD folders by its path inside them, and how many files were left out."""
    found: dict[Path, list[Source]] = {}
    skipped = 0
    for shard in shards:
        for path in sorted(shard.rglob("*.json")):
            if not path.is_file():
                continue
            source = read_source(path)
            if source is None:
                skipped += 1
                continue
            found.setdefault(path.relative_to(shard), []).append(source)
    for relative, sources in found.items():
        kinds = sorted({source.kind for source in sources})
        if len(kinds) > 1:
            listing = ", ".join(f"{source.path} ({source.kind})" for source in sources)
            raise MergeError(f"{relative}: the shards hold different kinds of file under this path: {listing}.")
    return found, skipped


# ---- results ------------------------------------------------------------------------------------------------------


def _common(values: Sequence[Any]) -> Any:
    """The one value all shards share, else None (the shards' own values stay in `merged_from`)."""
    distinct = {json.dumps(value, sort_keys=True) for value in values}
    return values[0] if len(distinct) == 1 else None


def merge_results(sources: Sequence[Source]) -> dict[str, Any]:
    """One results document from the shards': records concatenated by test id, the summary recomputed."""
    owner: dict[str, Path] = {}
    tests: list[dict[str, Any]] = []
    for source in sources:
        if source.document.get("schema") != 1:
            raise MergeError(f"{source.path}: results schema {source.document.get('schema')!r}; this version reads 1.")
        for test in source.document["tests"]:
            test_id = test.get("test_id") if isinstance(test, dict) else None
            if not isinstance(test_id, str):
                raise MergeError(f"{source.path}: a test record without a test_id: {str(test)[:200]}.")
            if test_id in owner:
                raise MergeError(
                    f"{test_id} is in both {owner[test_id]} and {source.path}: each test runs in one shard, so the "
                    "shards overlap (run with different --vllm-shard counts, or one shard twice) or the files come "
                    "from different runs. Merge the shards of one run."
                )
            owner[test_id] = source.path
            tests.append(test)
    tests.sort(key=lambda test: str(test["test_id"]))
    documents = [source.document for source in sources]
    headers = list(dict.fromkeys(str(document.get("header")) for document in documents))
    upgrades = [upgrade for document in documents for upgrade in document.get("upgrades") or ()]
    return {
        "schema": 1,
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": ", ".join(dict.fromkeys(str(document.get("host")) for document in documents)),
        "header": headers[0] if len(headers) == 1 else "merged: " + " / ".join(headers),
        **{key: _common([document.get(key) for document in documents]) for key in _ENVIRONMENT},
        # A server serves the tests of one config, and a config's tests are in one shard: startups add up.
        "server_startups": sum(int(document.get("server_startups") or 0) for document in documents),
        "leaked_server_pids": [pid for document in documents for pid in document.get("leaked_server_pids") or ()],
        "upgrades": sorted(upgrades, key=lambda upgrade: str(upgrade.get("test_id"))),
        "tests": tests,
        "summary": results_summary(tests),
        "merged_from": [
            {
                "file": str(source.path),
                "host": source.document.get("host"),
                "created_at": source.document.get("created_at"),
                "header": source.document.get("header"),
                "tests": len(source.document["tests"]),
            }
            for source in sources
        ],
    }


_ENVIRONMENT = ("tier", "device", "backend", "vllm_version")


# ---- entries: baselines and calibrations --------------------------------------------------------------------------


def merge_entries(
    what: str,
    base: Mapping[K, V],
    shards: Sequence[tuple[Path, Mapping[K, V]]],
    name: Callable[[K], str],
    base_path: Path | None,
    reconcile: Callable[[list[V]], V] | None = None,
) -> dict[K, V]:
    """Each key's value after the shards' changes to `base` (None: absent, so a shard that removed an entry changed
    it too): unchanged by all -> the base's; changed -> the changed value, which every shard that changed it must
    agree on, unless `reconcile` makes one value of the different ones they set."""
    keys = sorted({*base, *(key for _, entries in shards for key in entries)}, key=name)
    merged: dict[K, V] = {}
    for key in keys:
        before = base.get(key)
        changed = [(path, entries.get(key)) for path, entries in shards if entries.get(key) != before]
        value = changed[0][1] if changed else before
        values = [other for _, other in changed if other is not None]
        if reconcile is not None and len({json.dumps(other, sort_keys=True, default=repr) for other in values}) > 1:
            value = reconcile(values)
            changed = []
        for path, other in changed[1:]:
            if other != value:
                since = f" from {base_path}" if base_path is not None else ""
                states = ["removed" if state is None else "set" for state in (value, other)]
                raise MergeError(
                    f"{what} entry {name(key)}: {changed[0][0]} ({states[0]}) and {path} ({states[1]}) both changed "
                    f"it{since}, differently. Each test runs in one shard, so the shards overlap (different "
                    "--vllm-shard counts, one shard twice) or come from different runs; merge the files of one run, "
                    "or drop one of the two."
                )
        if value is not None:
            merged[key] = value
    return merged


def _env_name(key: tuple[str, str]) -> str:
    return f"{key[0]} [{key[1]}]"


def _baseline_entries(path: Path) -> dict[tuple[str, str], BaselineEntry]:
    try:
        return BaselineStore(path).load()
    except BaselineError as error:
        raise MergeError(str(error)) from None


def merge_baselines(out: Path, sources: Sequence[Source]) -> int:
    """The shards' baseline files into `out` (its current entries the base); the number of entries written."""
    shards = [(source.path, _baseline_entries(source.path)) for source in sources]
    count = 0

    def change(current: dict[tuple[str, str], BaselineEntry]) -> dict[tuple[str, str], BaselineEntry]:
        nonlocal count
        merged = merge_entries("baseline", current, shards, _env_name, out if current else None)
        count = len(merged)
        return merged

    try:
        BaselineStore(out).rewrite(change)
    except BaselineError as error:
        raise MergeError(str(error)) from None
    return count


def _calibration_entries(path: Path, document: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    entries = document.get("entries")
    if (
        document.get("format") != FORMAT_VERSION
        or not isinstance(entries, dict)
        or not all(isinstance(value, dict) for value in entries.values())
    ):
        raise MergeError(
            f"{path}: not a calibration file this version reads (expected "
            f'{{"format": {FORMAT_VERSION}, "entries": {{KEY: {{...}}}}}}).'
        )
    return {str(key): value for key, value in entries.items()}


def larger_overheads(values: list[dict[str, Any]]) -> dict[str, Any]:
    """One calibration from entries that shards measured differently: each overhead's largest value.

    A calibration key is the model, vLLM release, device and the flags that shape the profile run, so two configs
    of one model that differ in other flags (a utilization ladder, max_model_len) share it, and an unsharded run
    keeps whichever started last. The largest overheads make a plan that predicts no less memory than any shard
    measured: the safe side for a preflight."""
    merged: dict[str, Any] = {}
    for value in values:
        for field, given in value.items():
            current = merged.get(field)
            if current is None or (_is_number(given) and _is_number(current) and given > current):
                merged[field] = given  # other fields (`source`) keep the first shard's value
    return dict(sorted(merged.items()))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def merge_calibrations(out: Path, sources: Sequence[Source]) -> int:
    """The shards' calibration.json files into `out`, entry by entry as baselines (an entry shards measured
    differently: `larger_overheads`); the number of entries."""
    shards = [(source.path, _calibration_entries(source.path, source.document)) for source in sources]
    out.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{out}.lock", timeout=60):
        current: dict[str, dict[str, Any]] = {}
        if out.exists():
            read = read_source(out)
            if read is None or read.kind != "calibration":
                raise MergeError(f"{out}: exists and is not a calibration file; it was left as it is.")
            current = _calibration_entries(out, read.document)
        merged = merge_entries("calibration", current, shards, str, out if current else None, larger_overheads)
        text = json.dumps({"format": FORMAT_VERSION, "entries": merged}, indent=2, sort_keys=True) + "\n"
        _write_atomically(out, text)
    return len(merged)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---- the command --------------------------------------------------------------------------------------------------


def merge_file(out: Path, sources: Sequence[Source]) -> str:
    """Merge one file's shards into `out`; the line that says what was written."""
    kind = sources[0].kind
    if kind == "results":
        document = merge_results(sources)
        _write_atomically(out, dumps_results(document))
        return f"results: {len(document['tests'])} tests from {len(sources)} files -> {out}"
    if kind == "baseline":
        return f"baseline: {merge_baselines(out, sources)} entries from {len(sources)} files -> {out}"
    return f"calibration: {merge_calibrations(out, sources)} entries from {len(sources)} files -> {out}"


def _plan(out: Path, shards: Sequence[Path]) -> tuple[dict[Path, list[Source]], int]:
    """(OUT path -> the shards' files merged into it, files left out); raises ValueError for bad arguments."""
    missing = [str(shard) for shard in shards if not shard.exists()]
    if missing:
        raise ValueError(f"SHARD {', '.join(missing)}: no such file or folder")
    if all(shard.is_dir() for shard in shards):
        for shard in shards:
            if out.resolve() == shard.resolve() or shard.resolve() in out.resolve().parents:
                raise ValueError(f"OUT {out} is inside SHARD {shard}: give a folder outside the shards")
        found, skipped = gather(shards)
        if not found:
            raise ValueError(
                f"found no results, baseline or calibration JSON in {', '.join(map(str, shards))}: give the folders "
                "the shards' --vllm-results and --vllm-baseline files were written to (or the files themselves)"
            )
        return {out / relative: sources for relative, sources in sorted(found.items())}, skipped
    if any(shard.is_dir() for shard in shards):
        raise ValueError("SHARD arguments are folders and files mixed: give all folders (OUT a folder) or all files")
    if out.is_dir():
        raise ValueError(f"OUT {out} is a folder, but the SHARDs are files: give the file to write")
    sources: list[Source] = []
    for shard in shards:
        source = read_source(shard)
        if source is None:
            raise ValueError(f"SHARD {shard}: not a results, baseline or calibration JSON file of pytest-vllm-mem")
        sources.append(source)
    kinds = sorted({source.kind for source in sources})
    if len(kinds) > 1:
        raise ValueError(f"SHARD files of different kinds ({', '.join(kinds)}): merge one kind into one OUT file")
    return {out: sources}, 0


def run_merge(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        plan, skipped = _plan(args.out, args.shards)
    except ValueError as error:
        parser.error(str(error))
    except MergeError as error:
        print(f"merge: error: {error}", flush=True)
        return EXIT_CONFLICT
    failed = False
    for out, sources in plan.items():
        try:
            print(merge_file(out, sources), flush=True)
        except MergeError as error:
            print(f"merge: error: {error} {out} was not written.", flush=True)
            failed = True
    if skipped:
        print(f"left out {skipped} other JSON file(s) of the shards (not results, baseline or calibration)")
    return EXIT_CONFLICT if failed else EXIT_MERGED


def add_merge_parser(commands: Any) -> None:
    merge_parser = commands.add_parser(
        "merge",
        help="combine the results, baseline and calibration files of a suite's shards (--vllm-shard=K/N)",
        description="Merge the files the shards of one run wrote: results records concatenated with the summary "
        "recomputed from the raw per-request samples; baseline and calibration entries merged one by one "
        "into what OUT already holds (two shards changing one entry differently is an error). SHARDs are "
        "folders (files matched by their path inside; OUT a folder) or files of one kind (OUT a file). "
        "Exit 0 when merged, 1 when files disagree or cannot be read, 2 on bad input.",
    )
    merge_parser.add_argument("out", type=Path, metavar="OUT", help="folder (or file) to write the merged files to")
    merge_parser.add_argument("shards", type=Path, nargs="+", metavar="SHARD", help="a shard's folder or file")
    merge_parser.set_defaults(run=run_merge, command_parser=merge_parser)
