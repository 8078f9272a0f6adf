"""Score a diagnose module on this corpus: python tests/data/logs/score.py [path/to/diagnose.py] [-v] [--held-out-misses]

Without a path it scores the working tree's pytest_vllm_mem/diagnosis/diagnose.py. To score an older version:
    git show <commit>:pytest_vllm_mem/diagnosis/diagnose.py > /tmp/old_diagnose.py
    python tests/data/logs/score.py /tmp/old_diagnose.py
(before the restructure of issue 21 the module was pytest_vllm_mem/diagnose.py.)

Three scores are printed (BLINDn_RULES_SHA256 below, as in the corpus README, is batch n's `rules_sha256` in
FROZEN_BATCHES):
- corpus: every log the rules may be fitted to;
- held-out: a third of the 41 logs collected for issue 23 (`"batch": "issue23"` in index.json), chosen by a rule fixed
  before any of them was scored: a log is held out when the SHA-256 of its file name, read as a number, is divisible
  by 3;
- blind: 13 more logs (`"batch": "issue23-blind"`) collected after the rules were frozen (BLIND_RULES_SHA256 is the
  diagnose.py they were first scored with), all held out;
- blind 2: 27 more logs (`"batch": "issue23-blind2"`) collected after the rules were frozen a second time
  (BLIND2_RULES_SHA256), scored once with that diagnose.py;
- blind 3: 21 more logs (`"batch": "issue23-blind3"`) collected after the rules were frozen a third time
  (BLIND3_RULES_SHA256), scored once with that diagnose.py;
- blind 4: 31 more logs (`"batch": "issue23-blind4"`) collected after the rules were frozen a fourth time
  (BLIND4_RULES_SHA256), split by the same hash rule: the held-out third is reported on its own line, the other two
  thirds are in-sample (round 4's later rules were improved on them, so they do not count as never fitted);
- blind 5: more logs (`"batch": "issue23-blind5"`) collected after the rules were frozen a fifth time
  (BLIND5_RULES_SHA256), split and reported like blind 4;
- blind 6: more logs (`"batch": "issue23-blind6"`) collected after the rules were frozen a sixth time
  (BLIND6_RULES_SHA256, the diagnose.py of round 5's end), split and reported like blind 4;
- blind 7: more logs (`"batch": "issue23-blind7"`) collected after the rules were frozen a seventh time
  (BLIND7_RULES_SHA256, the diagnose.py of round 6's end), split and reported like blind 4;
- blind 8: more logs (`"batch": "issue23-blind8"`) collected after the rules were frozen an eighth time
  (BLIND8_RULES_SHA256, the diagnose.py of round 7's end), split and reported like blind 4;
- blind 9: more logs (`"batch": "issue23-blind9"`) collected after the rules were frozen a ninth time
  (BLIND9_RULES_SHA256, the diagnose.py of round 8's end, unchanged since round 7), split and reported like blind 4;
- blind 10: more logs (`"batch": "issue23-blind10"`) collected after the rules were frozen a tenth time
  (BLIND10_RULES_SHA256, the diagnose.py of round 9's end), split and reported like blind 4;
- blind 11: more logs (`"batch": "issue23-blind11"`) read after the rules were frozen an eleventh time
  (BLIND11_RULES_SHA256, round 11's cut-excerpt rule), split and reported like blind 4;
- blind 12: more logs (`"batch": "issue23-blind12"`) read after the rules were frozen a twelfth time
  (BLIND12_RULES_SHA256, round 12's final rules), split and reported like blind 4;
- blind 13: more logs (`"batch": "issue23-blind13"`) collected by a helper blind to the classifier after the rules were
  frozen a thirteenth time (BLIND13_RULES_SHA256, commit 847b613: round 12's rules, refactored with the same figures),
  split and reported like blind 4;
- blind 14: more logs (`"batch": "issue23-blind14"`) collected by a helper blind to the classifier after the rules were
  frozen a fourteenth time (BLIND14_RULES_SHA256, commit 8d047ae: round 13's rules), split and reported like blind 4;
- blind 15: more logs (`"batch": "issue23-blind15"`) collected by a helper blind to the classifier after the rules were
  frozen a fifteenth time (BLIND15_RULES_SHA256, commit 317cfc0: round 14's rules), split and reported like blind 4;
- blind 16: more logs (`"batch": "issue23-blind16"`) collected by a helper blind to the classifier after the rules were
  frozen a sixteenth time (BLIND16_RULES_SHA256, commit 2d46a01: round 15's rules), split and reported like blind 4;
- blind 17: more logs (`"batch": "issue23-blind17"`) collected by a helper blind to the classifier with the same rules
  still frozen (BLIND17_RULES_SHA256, the file of BLIND16_RULES_SHA256), split and reported like blind 4;
- blind 18: more logs (`"batch": "issue23-blind18"`) collected by a helper blind to the classifier after the rules were
  frozen again (BLIND18_RULES_SHA256, commit 8719f98: round 17's rules), split and reported like blind 4;
- blind 19: more logs (`"batch": "issue23-blind19"`) collected by a helper blind to the classifier with the same rules
  still frozen (BLIND19_RULES_SHA256, the file of BLIND18_RULES_SHA256; commit f06eed1 holds it too), split and
  reported like blind 4;
- blind 20: more logs (`"batch": "issue23-blind20"`) collected by a helper blind to the classifier after the rules were
  frozen again (BLIND20_RULES_SHA256, commit e2e9a8f: round 19's rules), split and reported like blind 4.
- blind 21: more logs (`"batch": "issue23-blind21"`) collected by two helpers blind to the classifier after the rules
  were frozen again (BLIND21_RULES_SHA256, commit 64d6c24: round 20's rules), split and reported like blind 4.
- blind 22: more logs (`"batch": "issue23-blind22"`) collected by two helpers blind to the classifier after the rules
  were frozen again (BLIND22_RULES_SHA256, commit 2d4f9b1: round 21's rules), split and reported like blind 4.
- blind 23: more logs (`"batch": "issue23-blind23"`) collected by two helpers blind to the classifier with the same
  rules (BLIND23_RULES_SHA256, commit 3cb88c2: round 21's rules, unchanged), split and reported like blind 4.
- blind 24: more logs (`"batch": "issue23-blind24"`) collected by two helpers blind to the classifier after the rules
  were frozen again (BLIND24_RULES_SHA256, commit 685d75e: round 23's rules), split and reported like blind 4.
- blind 25: more logs (`"batch": "issue23-blind25"`) collected by two helpers blind to the classifier with the same
  rules (BLIND25_RULES_SHA256, commit ca888e1: round 23's rules, unchanged), split and reported like blind 4.
- blind 26: more logs (`"batch": "issue23-blind26"`) collected by two helpers blind to the classifier after the rules
  were frozen again (BLIND26_RULES_SHA256, commit a8d2b9a: round 25's rules), split and reported like blind 4.
- blind 27: more logs (`"batch": "issue23-blind27"`) collected by two helpers blind to the classifier with the same
  rules (BLIND27_RULES_SHA256, commit ee8458c: round 25's rules, unchanged), split and reported like blind 4.
- blind 28: more logs (`"batch": "issue23-blind28"`) collected by two helpers blind to the classifier with the same
  rules (BLIND28_RULES_SHA256, commit 3a1ed2b: round 25's rules, unchanged), split and reported like blind 4.
- blind 29: more logs (`"batch": "issue23-blind29"`) collected by two helpers blind to the classifier with the same
  rules (BLIND29_RULES_SHA256, commit 102b5ac: round 25's rules, unchanged), split and reported like blind 4.
- blind 30: more logs (`"batch": "issue23-blind30"`) collected by two helpers blind to the classifier with the
  rules frozen again (BLIND30_RULES_SHA256, commit 70b8f33: round 29's rules), split and reported like blind 4.
- blind 31: more logs (`"batch": "issue23-blind31"`) collected by two helpers blind to the classifier with the
  rules frozen again (BLIND31_RULES_SHA256, commit dc35315: round 30's rules), split and reported like blind 4.
A further line adds up the held-out thirds of blind batches 4-31 (the target of issue 23: 95% on logs no rule saw).
`--frozen-held-out` scores each held-out third with its own batch's frozen rules (read from git: the figure of record)
and splits the total by `error_shown`: `"error_shown": false` marks a failure excerpt that stops before the line
stating its error (the error only in the issue's title or prose). Batch 10's were marked when it was collected, before
any scoring; the held-out thirds of batches 4-9 were marked afterwards by a helper that read only the log files (no
index, no scores) with a literal criterion (an exception line or an error message naming the failure; frames, a
Traceback header and wrapper lines such as "Engine core initialization failed" do not count).
Entries with `seen_before_rule` were missed by the rules they were first scored with and passed only after a later
rule was written with them in view: their pass is not a blind result, and each line says how many of them it holds.
The script prints the SHA-256 of the diagnose.py it scored, so a blind figure can be matched to its frozen rules.
`-v` lists the corpus misses; the held-out and blind misses are listed only with --held-out-misses, so that changing
a rule while looking at them is a deliberate act, not an accident of -v.

A module from before phases existed is given the phase its summary names ("while profiling", ...; weights_too_large
counts as loading_weights), so the phase figure compares like with like. A `started` log counts as read right when
parse_startup_memory gives its figures and find_memory_error finds nothing in it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
HELD_OUT_BATCH = "issue23"


class FrozenBatch(NamedTuple):
    """One blind batch, collected after its rules were frozen: its number (index.json's batch is "issue23-blind" and
    "issue23-blindN"), the ordinal its lines print (batches split in thirds only), the SHA-256 of the diagnose.py it
    was first scored with, and a commit holding that file (read back by --frozen-held-out; split batches only)."""

    number: int
    ordinal: str | None
    rules_sha256: str
    commit: str | None

    @property
    def batch(self) -> str:
        return "issue23-blind" if self.number == 1 else f"issue23-blind{self.number}"


# Every blind batch, in the order collected. Batches 1-3 are held out whole; from batch 4 each is split in thirds by
# the hash rule (is_held_out). A batch's history (which round's rules, why) is in the docstring above and in
# docs/diagnosis.md; adding a batch is one line here.
FROZEN_BATCHES = (
    FrozenBatch(1, None, "5e88b24c88858a7872abe59d3c11408abeda3fef6d466b70e1a6dad51f29be94", None),
    FrozenBatch(2, None, "c95d7e334f36ae016590dd445473e8efc8afa080b63e8ff199bcaecbf2a27e67", None),
    FrozenBatch(3, None, "1f48afc81a5759ee959287c6690ed1f70e93abb90b58bcea206abba04629ef79", None),
    FrozenBatch(4, "a fourth", "17c6cb9e2c2dd93b934c7478205d0c8efb2e291fbcb8ef97c9eb339277c62500", "cfe3a128"),
    FrozenBatch(5, "a fifth", "37d8cddfed97dd45caa8c91b5f51630bff6da5221f268bb8b7f133b367c8faee", "12680133"),
    FrozenBatch(6, "a sixth", "8af206fe1a962db3faa9bc0eed2a83f846151c6b5e6ab82394576a270639414a", "32feff74"),
    FrozenBatch(7, "a seventh", "71136fe6037ed7ecd5f007f5695a351ca4056a1da14b202e8b8b1d600e70f70e", "ba51b3d1"),
    FrozenBatch(8, "an eighth", "b7ae90f1f3b0169375c032ad6973b759e61ca41bdadc169e815f7afd84711bcc", "f1909746"),
    FrozenBatch(9, "a ninth", "b7ae90f1f3b0169375c032ad6973b759e61ca41bdadc169e815f7afd84711bcc", "f1909746"),
    FrozenBatch(10, "a tenth", "b98d90ca1e1f6605d24a8d0debf0cb2128d6a31caac393bc1d39bb7d6b1adc50", "76eb2fe8"),
    FrozenBatch(11, "an eleventh", "a9fc9b4174ee2be072e8f7a9c05039b4b066757e5b7f7a2729c24df720eb0121", "63b47c18"),
    FrozenBatch(12, "a twelfth", "0b89cfa7f301b2931fde9d45603523fdc6d1bbb53a4b24aaca3692f043a81c7d", "b46308a3"),
    FrozenBatch(13, "a thirteenth", "3507970d8465492a5cd88f84d827aeea795a948b976f87e47ee1c86303dcbf79", "847b613f"),
    FrozenBatch(14, "a fourteenth", "0d2cc5e5cb93368e81d94c891e1368002d7b2ec35a9babe1c893b7e5d55d7dfe", "8d047aeb"),
    FrozenBatch(15, "a fifteenth", "41fa85f6e1aff9701a9e97ffc46191a086a16a5c032fdc3a3ef9f91e5ba58ecb", "317cfc0c"),
    FrozenBatch(16, "a sixteenth", "4376070570b78fdabf1f317a80461c532a97f34bb8fe283159f165d5f9baf458", "2d46a01d"),
    FrozenBatch(17, "a seventeenth", "4376070570b78fdabf1f317a80461c532a97f34bb8fe283159f165d5f9baf458", "2d46a01d"),
    FrozenBatch(18, "an eighteenth", "194c90173442a5f18009a1367b6216ed891b7cf178d93e809e2fcb80779e723f", "8719f989"),
    FrozenBatch(19, "a nineteenth", "194c90173442a5f18009a1367b6216ed891b7cf178d93e809e2fcb80779e723f", "8719f989"),
    FrozenBatch(20, "a twentieth", "4905882f5a01a9b80d158233b45960a78ebffe372774c019be08743335022d71", "e2e9a8f1"),
    FrozenBatch(21, "a twenty-first", "460c67d6b2bcd4163b3122b9fd9f6082732327082d0d00b9deef785e463c1c6c", "64d6c242"),
    FrozenBatch(22, "a twenty-second", "72cc4bd7b0217eb9a2ff8cb6ffe0e6af68f9a55470b2b59f947765a20854cb65", "2d4f9b1e"),
    FrozenBatch(23, "a twenty-third", "72cc4bd7b0217eb9a2ff8cb6ffe0e6af68f9a55470b2b59f947765a20854cb65", "3cb88c21"),
    FrozenBatch(24, "a twenty-fourth", "ae1a3cbf8505296541667a69e0f9f9291ae08769725973d4ff08ac7d9a28d3c5", "685d75ec"),
    FrozenBatch(25, "a twenty-fifth", "ae1a3cbf8505296541667a69e0f9f9291ae08769725973d4ff08ac7d9a28d3c5", "ca888e1b"),
    FrozenBatch(26, "a twenty-sixth", "567fd0da51634367b1b40b6e82cbd279878e7e966a5c2ea3df626573df70b3e1", "a8d2b9a9"),
    FrozenBatch(27, "a twenty-seventh", "567fd0da51634367b1b40b6e82cbd279878e7e966a5c2ea3df626573df70b3e1", "ee8458cb"),
    FrozenBatch(28, "a twenty-eighth", "567fd0da51634367b1b40b6e82cbd279878e7e966a5c2ea3df626573df70b3e1", "3a1ed2b2"),
    FrozenBatch(29, "a twenty-ninth", "567fd0da51634367b1b40b6e82cbd279878e7e966a5c2ea3df626573df70b3e1", "102b5ac9"),
    FrozenBatch(30, "a thirtieth", "7659080534ebc80980062a6a11a112e19b9ec966e40e272cc5a5efe35a5ad46f", "70b8f33f"),
    FrozenBatch(31, "a thirty-first", "d943b3e98d251acba7d3841ef164b78307f51da84a10f90d1135d947317b9868", "dc35315c"),
)
BLIND_BATCH, BLIND2_BATCH, BLIND3_BATCH = (one.batch for one in FROZEN_BATCHES[:3])
# The batches split in thirds by the hash rule, with the ordinal their lines are printed with.
SPLIT_BATCHES = {one.batch: one.ordinal for one in FROZEN_BATCHES if one.ordinal}
# Every blind batch, in the order collected, with the diagnose.py its rules were frozen at.
FROZEN_RULES = {one.batch: one.rules_sha256 for one in FROZEN_BATCHES}
# A commit whose diagnose.py is each split batch's frozen file (checked against FROZEN_RULES when it is read).
FROZEN_COMMITS = {one.batch: one.commit for one in FROZEN_BATCHES if one.commit}
_OLD_PHASE_WORDS = (
    ("while profiling", "profiling"),
    ("while allocating the KV cache", "kv_cache_allocation"),
    ("while capturing CUDA graphs", "graph_capture"),
    ("while warming up", "sampler_warmup"),
    ("right after startup", "serving"),
    ("while serving", "serving"),
)


def is_held_out(name: str, entry: dict[str, Any]) -> bool:
    """The split rule, fixed before the issue-23 logs were scored: a third of that batch (and of every batch in
    SPLIT_BATCHES, blind batches 4 on), by a hash of the name."""
    return (entry.get("batch") == HELD_OUT_BATCH or entry.get("batch") in SPLIT_BATCHES) and int(
        hashlib.sha256(name.encode()).hexdigest(), 16
    ) % 3 == 0


def frozen_label(digest: str) -> str:
    """' (the rules frozen for blind batches 8 and 9)' when `digest` is the diagnose.py some batches were frozen at."""
    numbers = [str(n) for n, frozen in enumerate(FROZEN_RULES.values(), start=1) if frozen == digest]
    if not numbers:
        return ""
    if len(numbers) == 1:
        return f" (the rules frozen for blind batch {numbers[0]})"
    return f" (the rules frozen for blind batches {', '.join(numbers[:-1])} and {numbers[-1]})"


def frozen_module(batch: str, folder: Path) -> ModuleType:
    """The diagnose.py `batch` was first scored with, written into `folder` from git and loaded."""
    for path in ("pytest_vllm_mem/diagnosis/diagnose.py", "pytest_vllm_mem/diagnose.py"):
        shown = subprocess.run(
            ["git", "show", f"{FROZEN_COMMITS[batch]}:{path}"], cwd=ROOT, capture_output=True, check=False
        )
        if shown.returncode == 0:
            break
    if hashlib.sha256(shown.stdout).hexdigest() != FROZEN_RULES[batch]:
        raise SystemExit(f"{batch}: commit {FROZEN_COMMITS[batch]} does not hold its frozen diagnose.py")
    target = folder / f"frozen_{batch.replace('-', '_')}.py"
    target.write_bytes(shown.stdout)
    return load(target)


def frozen_held_out(index: dict[str, Any]) -> None:
    """Each split batch's held-out third scored with that batch's frozen rules, by whether the excerpt shows its
    error line."""
    parts = {"failure excerpts showing their error line": Score(), "failure excerpts cut before it": Score()}
    parts["started servers"] = Score()
    with tempfile.TemporaryDirectory() as folder:
        for batch in SPLIT_BATCHES:
            module = frozen_module(batch, Path(folder))
            for name, entry in index.items():
                if entry.get("batch") != batch or not is_held_out(name, entry):
                    continue
                if entry["kind"] == "started":
                    key = "started servers"
                elif entry.get("error_shown", True):
                    key = "failure excerpts showing their error line"
                else:
                    key = "failure excerpts cut before it"
                score_entry(module, name, entry, parts[key])
    for part in parts.values():
        part.seen = 0  # each log is scored as its batch's frozen rules first scored it: no later rule is in it
    label = f"held-out thirds of blind batches 4-{3 + len(SPLIT_BATCHES)}, each with its frozen rules"
    for key, part in parts.items():
        print(part.line(f"{label}, {key}"))
    print(together(tuple(parts.values())).line(f"{label}, all"))


def load(path: Path) -> ModuleType:
    """The module at `path`, loaded inside the pytest_vllm_mem package so its relative imports resolve."""
    sys.path.insert(0, str(ROOT))
    importlib.import_module("pytest_vllm_mem")
    spec = importlib.util.spec_from_file_location("pytest_vllm_mem._scored_diagnose", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def phase_of(diagnosis: Any) -> str | None:
    if hasattr(diagnosis, "phase"):
        return diagnosis.phase  # type: ignore[no-any-return]
    if diagnosis.kind == "weights_too_large":
        return "loading_weights"
    return next((phase for words, phase in _OLD_PHASE_WORDS if words in diagnosis.summary), None)


@dataclass
class Score:
    kinds: int = 0
    total: int = 0
    phases: int = 0
    phase_total: int = 0
    started: int = 0
    started_total: int = 0
    misses: list[str] = field(default_factory=list)
    seen: int = 0  # logs whose pass came from a rule written after they were seen (seen_before_rule)

    def line(self, label: str) -> str:
        right = self.kinds + self.started
        logs = self.total + self.started_total
        seen = f" ({self.seen} of them seen before a later rule)" if self.seen else ""
        return (
            f"{label}: {right}/{logs} logs right ({right / max(logs, 1):.0%}): failure kind {self.kinds}/{self.total}, "
            f"out-of-memory kind and phase {self.phases}/{self.phase_total}, started logs read "
            f"{self.started}/{self.started_total}{seen}"
        )


def score_entry(module: ModuleType, name: str, entry: dict[str, Any], score: Score) -> None:
    text = (HERE / name).read_text(encoding="utf-8")
    score.seen += "seen_before_rule" in entry
    if entry["kind"] == "started":
        score.started_total += 1
        memory = module.parse_startup_memory(text).to_dict()
        read = {key: memory.get(key) for key in entry["memory"]}
        found = module.find_memory_error(text) if hasattr(module, "find_memory_error") else None
        if read == entry["memory"] and found is None:
            score.started += 1
        else:
            wrong = {key: value for key, value in read.items() if value != entry["memory"][key]}
            score.misses.append(f"miss {name}: started, read {wrong}" + (f", found {found.kind}" if found else ""))
        return
    diagnosis = module.classify_failure(text, 1)
    score.total += 1
    kind_ok = diagnosis.kind == entry["kind"]
    score.kinds += kind_ok
    phase_ok = None
    if "phase" in entry and entry["kind"] in ("cuda_oom", "weights_too_large"):
        score.phase_total += 1
        phase_ok = kind_ok and phase_of(diagnosis) == entry["phase"]
        score.phases += phase_ok
    if not kind_ok or phase_ok is False:
        score.misses.append(
            f"miss {name}: expected {entry['kind']}/{entry.get('phase')}, got {diagnosis.kind}/{phase_of(diagnosis)}"
        )


def together(parts: tuple[Score, ...]) -> Score:
    """The sum of several sets' scores (their misses are not carried)."""
    total = Score(
        *(
            sum(getattr(part, name) for part in parts)
            for name in ("kinds", "total", "phases", "phase_total", "started", "started_total")
        )
    )
    total.seen = sum(part.seen for part in parts)
    return total


def main(argv: list[str]) -> int:
    paths = [a for a in argv if not a.startswith("-")]
    path = Path(paths[0]) if paths else ROOT / "pytest_vllm_mem" / "diagnosis" / "diagnose.py"
    index = json.loads((HERE / "index.json").read_text(encoding="utf-8"))
    if "--frozen-held-out" in argv:
        frozen_held_out(index)
        return 0
    module = load(path)
    corpus, held_out, blind, blind2, blind3 = Score(), Score(), Score(), Score(), Score()
    split = {batch: (Score(), Score()) for batch in SPLIT_BATCHES}  # (in-sample two thirds, held-out third)
    sets = {BLIND_BATCH: blind, BLIND2_BATCH: blind2, BLIND3_BATCH: blind3}
    for name, entry in index.items():
        if entry.get("batch") in split:
            in_sample, held = split[entry["batch"]]
            chosen = held if is_held_out(name, entry) else in_sample
        else:
            chosen = sets.get(entry.get("batch", ""), held_out if is_held_out(name, entry) else corpus)
        score_entry(module, name, entry, chosen)
    held_thirds = tuple(held for _, held in split.values())
    if "-v" in argv:
        fitted = (corpus, *(in_sample for in_sample, _ in split.values()))
        print("\n".join(miss for part in fitted for miss in part.misses))
    never_fitted = (held_out, blind, blind2, blind3, *held_thirds)
    if "--held-out-misses" in argv:
        print("\n".join(miss for part in never_fitted for miss in part.misses))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    print(f"rules scored: {path.name} sha256 {digest[:12]}{frozen_label(digest)}")
    print(corpus.line("corpus"))
    print(held_out.line("held-out third of issue 23's logs"))
    print(blind.line("blind batch (collected after the rules froze)"))
    print(blind2.line("blind batch 2 (collected after the rules froze again)"))
    print(blind3.line("blind batch 3 (collected after the rules froze a third time)"))
    for number, (batch, ordinal) in enumerate(SPLIT_BATCHES.items(), start=4):
        in_sample, held = split[batch]
        print(
            in_sample.line(
                f"blind batch {number}, in-sample two thirds (collected after the rules froze {ordinal} time)"
            )
        )
        print(held.line(f"blind batch {number}, held-out third"))
    print(together(held_thirds).line(f"held-out thirds of blind batches 4-{3 + len(SPLIT_BATCHES)}"))
    print(together(never_fitted).line("never fitted, together"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
