"""--vllm-shard=K/N (plugin/shard.py) and `python -m pytest_vllm_mem merge` (cli/merge.py): the split is the same
whatever the collection order, keeps a config's tests together, balances the shards and names bad input; the merge
concatenates records, recomputes percentiles from raw samples (exact, unlike an average of the shards'), and merges
baseline and calibration entries, refusing two shards that changed one entry differently."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from e2e import CACHE_DIR

from pytest_vllm_mem import VLLMConfig
from pytest_vllm_mem.baseline.store import BaselineEntry, BaselineStore, EnvKey
from pytest_vllm_mem.baseline.summary import dumps_results, latency_summary, pooled_load, results_summary, to_us
from pytest_vllm_mem.cli.main import main
from pytest_vllm_mem.cli.merge import MergeError, Source, merge_entries, merge_results
from pytest_vllm_mem.load.client import LoadSpec, Percentiles, _Load, _Request, _summarize
from pytest_vllm_mem.plugin.shard import STARTUP_COST, Shard, assign_groups, parse_shard, split_items
from pytest_vllm_mem.settings import UsageError

# ---- the split ------------------------------------------------------------------------------------------------------


@dataclass
class CallSpec:
    params: dict[str, object]


@dataclass
class Item:
    nodeid: str
    fixturenames: tuple[str, ...] = ("vllm_load", "vllm_server", "vllm_config")
    callspec: CallSpec | None = None
    extra: dict[str, object] = field(default_factory=dict)


def item(nodeid: str, config: Any = None, fixtures: tuple[str, ...] | None = None) -> Item:
    made = Item(nodeid, callspec=CallSpec({"vllm_config": config}) if config is not None else None)
    if fixtures is not None:
        made.fixturenames = fixtures
    return made


CONFIGS = [VLLMConfig("tiny", max_model_len=512 * (1 + i), gpu_memory_utilization=0.1) for i in range(7)]


def suite() -> list[Item]:
    items = [item(f"t.py::test_{name}[{i}]", config) for i, config in enumerate(CONFIGS) for name in ("a", "b")]
    items += [item(f"t.py::test_c[{i}]", CONFIGS[i]) for i in (0, 3)]  # two configs with a third test
    items += [item(f"t.py::test_plain{i}", fixtures=("tmp_path",)) for i in range(3)]
    return items


def shards_of(items: list[Item], count: int) -> list[list[str]]:
    return [sorted(i.nodeid for i in split_items(items, Shard(k, count))[0]) for k in range(1, count + 1)]


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_the_split_is_the_same_in_any_collection_order_and_covers_each_test_once(count: int) -> None:
    items = suite()
    expected = shards_of(items, count)
    for seed in range(5):
        shuffled = items[:]
        random.Random(seed).shuffle(shuffled)
        assert shards_of(shuffled, count) == expected
    every = [nodeid for shard in expected for nodeid in shard]
    assert sorted(every) == sorted(i.nodeid for i in items) and len(every) == len(set(every))


def test_selected_tests_keep_their_order_and_the_others_are_deselected() -> None:
    items = suite()
    selected, deselected = split_items(items, Shard(2, 3))
    assert selected == [i for i in items if i in selected] and deselected == [i for i in items if i not in selected]
    assert selected and deselected


def test_the_tests_of_one_config_stay_in_one_shard() -> None:
    items = suite()
    for count in (2, 3, 4):
        for k in range(1, count + 1):
            chosen = split_items(items, Shard(k, count))[0]
            for config in CONFIGS:
                members = [i for i in items if i.callspec and i.callspec.params["vllm_config"] == config]
                assert all(m in chosen for m in members) or not any(m in chosen for m in members)


def test_equal_configs_written_differently_are_one_group() -> None:
    """VLLMConfig's equality: flag order and 4096 vs "4096" name the same server, on every machine."""
    one = VLLMConfig("tiny", max_model_len=4096, enforce_eager=True)
    same = VLLMConfig("tiny", enforce_eager=True, max_model_len="4096")
    items = [item("t.py::a", one), item("t.py::b", same), *(item(f"t.py::x{i}", CONFIGS[i]) for i in range(4))]
    for k in (1, 2):
        chosen = {i.nodeid for i in split_items(items, Shard(k, 2))[0]}
        assert {"t.py::a", "t.py::b"} <= chosen or not {"t.py::a", "t.py::b"} & chosen


def test_the_shards_are_balanced_by_startups_and_tests() -> None:
    items = [item(f"t.py::test[{i}-{n}]", CONFIGS[i]) for i in range(6) for n in range(2)]  # 6 configs x 2 tests
    for shard in shards_of(items, 2):
        assert len(shard) == 6  # 3 configs each
    # Greedy, costliest first: one big config alone, the small ones together.
    costs = {"big": 10.0, "s1": 4.0, "s2": 3.0, "s3": 3.0}
    assigned = assign_groups(costs, 2)
    assert assigned["big"] != assigned["s1"] and assigned["s2"] == assigned["s3"] == assigned["s1"]
    loads = [sum(cost for name, cost in costs.items() if assigned[name] == k) for k in (1, 2)]
    assert sorted(loads) == [10.0, 10.0]
    # The cost counts startups: 4 configs of 1 test vs 1 config of 4 tests is 16 vs 7.
    assert STARTUP_COST > 0


def test_more_shards_than_groups_leaves_some_empty() -> None:
    items = [item("t.py::a", CONFIGS[0]), item("t.py::b", CONFIGS[0])]
    assert sorted(map(len, shards_of(items, 3))) == [0, 0, 2]


@pytest.mark.parametrize("text", ["1/2", " 2 / 2 ", "1/1", "7/12"])
def test_good_shard_values(text: str) -> None:
    shard = parse_shard(text)
    assert shard is not None and str(shard) == text.replace(" ", "")


@pytest.mark.parametrize("text", ["0/2", "3/2", "a/b", "1/0", "2", "1/2/3", "-1/2", "1.5/2"])
def test_bad_shard_values_are_one_paragraph_naming_the_input(text: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_shard(text)
    message = str(caught.value)
    assert repr(text) in message and "K/N" in message and "1 <= K <= N" in message and "\n" not in message


def test_no_shard_selects_everything() -> None:
    assert parse_shard(None) is None and parse_shard("") is None


# ---- through pytest -------------------------------------------------------------------------------------------------

INNER = """
import pytest
from pytest_vllm_mem import VLLMConfig

CONFIGS = [VLLMConfig("tiny", max_model_len=m, gpu_memory_utilization=0.1) for m in (256, 512, 1024)]

@pytest.fixture
def vllm_server(vllm_config):  # a stand-in: these runs check the selection, not the servers
    return vllm_config

@pytest.mark.parametrize("vllm_config", CONFIGS, ids=["a", "b", "c"])
@pytest.mark.parametrize("n", [1, 2])
def test_serves(vllm_server, n):
    pass

def test_plain():
    pass
"""


def selected(result: pytest.RunResult) -> set[str]:
    return {line.split(" ")[0] for line in result.stdout.lines if "::" in line and " PASSED" in line}


def test_shards_through_pytest_cover_the_suite_and_report_deselected(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    everything = pytester.runpytest("-p", "no:cacheprovider", "-v")
    everything.assert_outcomes(passed=7)
    parts = []
    for k in (1, 2):
        result = pytester.runpytest("-p", "no:cacheprovider", "-v", f"--vllm-shard={k}/2")
        parts.append(selected(result))
        result.assert_outcomes(passed=len(parts[-1]), deselected=7 - len(parts[-1]))
    assert parts[0] | parts[1] == selected(everything) and not parts[0] & parts[1]
    # The ini key works too, and the command line wins over it.
    pytester.makeini("[pytest]\nvllm_shard = 2/2\n")
    assert selected(pytester.runpytest("-p", "no:cacheprovider", "-v")) == parts[1]
    assert selected(pytester.runpytest("-p", "no:cacheprovider", "-v", "--vllm-shard=1/2")) == parts[0]


def test_shards_under_xdist_select_the_same_tests(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(test_inner=INNER)
    alone = selected(pytester.runpytest("-p", "no:cacheprovider", "-v", "--vllm-shard=1/2"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", "-n", "2", "--vllm-shard=1/2")
    passed = {match.group(1) for line in result.stdout.lines if (match := re.search(r"PASSED (\S+)", line))}
    assert passed == alone, result.stdout.str()


PREFLIGHT = """
import pytest
from pytest_vllm_mem import VLLMConfig

CONFIGS = [VLLMConfig("tiny", max_model_len=m, gpu_memory_utilization=0.1) for m in (256, 512, 1024)]

@pytest.mark.parametrize("vllm_config", CONFIGS, ids=["a", "b", "c"])
@pytest.mark.parametrize("n", [1, 2])
def test_serves(vllm_server, n):
    pass
"""


def test_shards_of_a_preflight_plan_the_same_split(pytester: pytest.Pytester) -> None:
    """--vllm-preflight with the real fixtures: each shard plans (never starts) its own configs' tests."""
    pytester.makepyfile(test_inner=PREFLIGHT)
    cache = f"--vllm-cache-dir={CACHE_DIR}"
    parts = []
    for k in (1, 2):
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "-v", "--vllm-preflight", cache, f"--vllm-shard={k}/2"
        )
        parts.append(selected(result))
        result.assert_outcomes(passed=len(parts[-1]), deselected=6 - len(parts[-1]))
        assert "planned" in result.stdout.str()
    assert len(parts[0] | parts[1]) == 6 and not parts[0] & parts[1]
    assert {len(part) for part in parts} == {2, 4}  # whole configs: 2 tests each


@pytest.mark.parametrize("value", ["0/2", "3/2", "a/b"])
def test_a_bad_shard_is_a_usage_error(pytester: pytest.Pytester, value: str) -> None:
    pytester.makepyfile(test_inner="def test_a(): pass")
    result = pytester.runpytest("-p", "no:cacheprovider", f"--vllm-shard={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    output = result.stdout.str() + result.stderr.str()
    assert f"--vllm-shard={value!r}: expected K/N" in output and "Traceback" not in output


# ---- raw samples and percentiles ----------------------------------------------------------------------------------


def test_a_load_keeps_its_raw_samples_and_its_percentiles_are_theirs() -> None:
    spec = LoadSpec(num_prompts=3, concurrency=1)
    load = _Load("http://127.0.0.1:1/v1/completions", [b""] * 3, spec, None, None)
    for index, (ttft, latency, out) in enumerate([(0.010, 0.050, 5), (0.0123456, 0.1, 9), (0.02, 0.021, 1)]):
        request = _Request()
        request.ttft, request.latency, request.output_tokens = ttft, latency, out
        request.itl = [(latency - ttft) / max(out - 1, 1)] * (out - 1)
        load.records[index] = request
    result = _summarize(load, spec, 1.0)
    samples = result.to_dict()["samples_us"]
    assert samples["ttft"] == [10000, 12346, 20000] and samples["e2el"] == [50000, 100000, 21000]
    assert len(samples["tpot"]) == 2 and len(samples["itl"]) == 4 + 8  # one TPOT per request with >1 token
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert getattr(result, name) == Percentiles.of_us(samples[name])
        assert result.to_dict()[f"{name}_ms"] == latency_summary(samples[name])


def test_latency_summary_is_numpys_and_independent_of_order() -> None:
    samples = [5000, 1000, 9000, 3000, 7000, 2000, 8000]
    ms = np.array(samples) / 1000
    summary = latency_summary(samples)
    assert summary == latency_summary(sorted(samples, reverse=True))
    assert summary["p99"] == np.percentile(ms, 99) and summary["p50"] == np.median(ms) and summary["mean"] == 5.0
    assert latency_summary([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    assert to_us([0.0012344, 0.0012346]) == [1234, 1235]


def record(test_id: str, config: str, *sample_sets: list[int], outcome: str = "ok") -> dict[str, Any]:
    loads = [
        {
            "num_prompts": len(samples),
            "completed": len(samples),
            "failed": 0,
            "total_output_tokens": 4 * len(samples),
            "total_input_tokens": 8 * len(samples),
            "ttft_ms": latency_summary(samples),
            "samples_us": {"ttft": samples, "tpot": samples, "itl": samples, "e2el": samples},
        }
        for samples in sample_sets
    ]
    return {"test_id": test_id, "config": config, "launched": config, "outcome": outcome, "loads": loads}


def results(host: str, *tests: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema": 1,
        "created_at": "2026-12-01T20:00:00Z",
        "host": host,
        "header": "tier 24gb, cpu device x, vLLM 0.32.0",
        "tier": "24gb",
        "device": "x",
        "backend": "cpu",
        "vllm_version": "0.32.0",
        "server_startups": len({t["config"] for t in tests}),
        "leaked_server_pids": [],
        "upgrades": [],
        "tests": list(tests),
        "summary": results_summary(list(tests)),
    }


FAST = list(range(1000, 1100))  # 100 requests at 1.0-1.1 ms
SLOW = [50_000, 60_000, 70_000, 400_000]  # 4 requests, one very slow


def test_merged_percentiles_are_the_pooled_samples_not_an_average_of_the_shards() -> None:
    one = results("a", record("t.py::x[1]", "vllm serve a", FAST))
    two = results("b", record("t.py::x[2]", "vllm serve b", SLOW))
    merged = merge_results([Source(Path("1.json"), "results", one), Source(Path("2.json"), "results", two)])
    p99 = merged["summary"]["load"]["ttft_ms"]["p99"]
    pooled = np.array(sorted(FAST + SLOW)) / 1000
    assert p99 == float(np.percentile(pooled, 99))
    # What averaging the shards' p99 would claim: far from it (the slow shard has few requests).
    averaged = (one["summary"]["load"]["ttft_ms"]["p99"] + two["summary"]["load"]["ttft_ms"]["p99"]) / 2
    assert abs(averaged - p99) > 10
    # The merge equals one run over both tests: the summary of the concatenated records.
    assert merged["summary"] == results_summary([*one["tests"], *two["tests"]])
    assert merged["summary"]["load"]["requests"] == 104 and merged["server_startups"] == 2


def test_merged_records_are_sorted_by_test_id_and_the_environment_kept() -> None:
    one = results("a", record("t.py::z", "c1", FAST), record("t.py::b", "c1", FAST))
    two = results("b", record("t.py::m", "c2", SLOW, SLOW))
    merged = merge_results([Source(Path("1.json"), "results", one), Source(Path("2.json"), "results", two)])
    assert [t["test_id"] for t in merged["tests"]] == ["t.py::b", "t.py::m", "t.py::z"]
    assert merged["host"] == "a, b" and merged["tier"] == "24gb" and merged["header"] == one["header"]
    assert [m["tests"] for m in merged["merged_from"]] == [2, 1]
    assert merged["summary"]["configs"]["c2"]["load"]["loads"] == 2


def test_a_test_in_two_shards_is_an_error_naming_both_files() -> None:
    one = results("a", record("t.py::x", "c", FAST))
    with pytest.raises(MergeError, match=r"t.py::x is in both shard-1/r.json and shard-2/r.json"):
        merge_results([Source(Path("shard-1/r.json"), "results", one), Source(Path("shard-2/r.json"), "results", one)])


def test_loads_without_samples_are_counted_not_guessed() -> None:
    old = {"num_prompts": 3, "completed": 3, "ttft_ms": {"p99": 5.0}}  # a results file from before samples
    pooled = pooled_load([old, {**old, "samples_us": {}}, {**record("t", "c", [7000])["loads"][0]}])
    assert pooled["loads_without_samples"] == 2 and pooled["ttft_ms"]["p99"] == 7.0 and pooled["requests"] == 7


def test_results_files_keep_sample_arrays_on_one_line() -> None:
    document = {"tests": [{"samples_us": {"ttft": [1, 2, 3]}, "log": "a [1,\n 2] b", "pids": []}]}
    text = dumps_results(document)
    assert json.loads(text) == document and '"ttft": [1, 2, 3]' in text and text.endswith("\n")


# ---- entries: baselines and calibrations --------------------------------------------------------------------------


def test_entries_merge_against_the_base() -> None:
    base = {"kept": 1, "changed": 1, "removed": 1}
    one = {"kept": 1, "changed": 2, "removed": 1, "new1": 5}
    two = {"kept": 1, "changed": 1, "new2": 6}  # pruned "removed"
    merged = merge_entries("x", base, [(Path("1"), one), (Path("2"), two)], str, Path("base"))
    assert merged == {"kept": 1, "changed": 2, "new1": 5, "new2": 6}
    same = merge_entries("x", {}, [(Path("1"), {"k": 1}), (Path("2"), {"k": 1})], str, None)
    assert same == {"k": 1}  # identical entries are no conflict
    with pytest.raises(MergeError, match=r"x entry k: 1 \(set\) and 2 \(set\) both changed it, differently"):
        merge_entries("x", {}, [(Path("1"), {"k": 1}), (Path("2"), {"k": 2})], str, None)


def entry(test_id: str, value: float, host: str = "h") -> BaselineEntry:
    env = EnvKey("24gb", "cpu x", "0.32.0")
    return BaselineEntry.from_samples(
        test_id, env, {"output_throughput": [value]}, config="vllm serve tiny", host=host, recorded_at="2026-12-01"
    )


def write_baseline(path: Path, *entries: BaselineEntry) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    BaselineStore(path).update(entries)


def run_merge(*args: Path) -> int:
    try:
        return main(["merge", *map(str, args)])
    except SystemExit as exit:
        return int(exit.code or 0)


def test_merge_folders_of_baselines_calibrations_and_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one, two, out = tmp_path / "shard-1", tmp_path / "shard-2", tmp_path / "out"
    write_baseline(one / ".vllm-mem" / "baselines.json", entry("t::a", 10), entry("t::shared", 5))
    write_baseline(two / ".vllm-mem" / "baselines.json", entry("t::b", 20), entry("t::shared", 5))
    (one / ".vllm-mem" / "calibration.json").write_text(
        json.dumps(
            {"format": 1, "entries": {"tiny|0.32|x|": {"cpu_non_kv_bytes": 100, "cpu_other_bytes": 7, "source": "c"}}}
        )
    )
    (two / ".vllm-mem" / "calibration.json").write_text(
        json.dumps(
            {
                "format": 1,
                "entries": {
                    "tiny|0.32|x|": {"cpu_non_kv_bytes": 120, "cpu_other_bytes": 5, "source": "c"},
                    "tiny|0.32|x|max_num_seqs=4": {"cpu_non_kv_bytes": 90},
                },
            }
        )
    )
    (one / "results.json").write_text(json.dumps(results("a", record("t::a", "c1", FAST))))
    (two / "results.json").write_text(json.dumps(results("b", record("t::b", "c2", SLOW))))
    (two / "notes.json").write_text('{"mine": 1}')
    assert run_merge(out, one, two) == 0
    printed = capsys.readouterr().out
    assert "baseline: 3 entries from 2 files" in printed and "results: 2 tests from 2 files" in printed
    assert "left out 1 other JSON file" in printed
    merged = BaselineStore(out / ".vllm-mem" / "baselines.json").load()
    assert sorted(test_id for test_id, _ in merged) == ["t::a", "t::b", "t::shared"]
    assert merged[("t::a", "24gb|cpu x|vllm 0.32.0")] == entry("t::a", 10)
    calibration = json.loads((out / ".vllm-mem" / "calibration.json").read_text())["entries"]
    # One key measured differently by two shards: the larger overheads, the safe side for a plan.
    assert calibration == {
        "tiny|0.32|x|": {"cpu_non_kv_bytes": 120, "cpu_other_bytes": 7, "source": "c"},
        "tiny|0.32|x|max_num_seqs=4": {"cpu_non_kv_bytes": 90},
    }
    assert len(json.loads((out / "results.json").read_text())["tests"]) == 2


def test_conflicting_baseline_entries_name_both_files_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one, two, out = tmp_path / "shard-1" / "b.json", tmp_path / "shard-2" / "b.json", tmp_path / "merged.json"
    write_baseline(one, entry("t::a", 10))
    write_baseline(two, entry("t::a", 11))
    assert run_merge(out, one, two) == 1
    printed = capsys.readouterr().out
    assert f"baseline entry t::a [24gb|cpu x|vllm 0.32.0]: {one} (set) and {two} (set)" in printed
    assert not out.exists()


def test_merging_into_the_file_the_shards_started_from(tmp_path: Path) -> None:
    """CI: OUT holds the repository's baseline; shard 1 refreshed t::a, shard 2 left it: shard 1's entry wins."""
    out, one, two = tmp_path / "repo.json", tmp_path / "1.json", tmp_path / "2.json"
    write_baseline(out, entry("t::a", 10), entry("t::b", 20))
    write_baseline(one, entry("t::a", 15), entry("t::b", 20))
    write_baseline(two, entry("t::a", 10), entry("t::b", 25))
    assert run_merge(out, one, two) == 0
    merged = BaselineStore(out).load()
    assert [e.metrics["output_throughput"] for e in merged.values()] == [15.0, 25.0]


def test_bad_merge_arguments_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "shard"
    folder.mkdir()
    (folder / "r.json").write_text(json.dumps(results("a", record("t::a", "c", FAST))))
    assert run_merge(tmp_path / "out", tmp_path / "missing") == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert run_merge(tmp_path / "out", folder, folder / "r.json") == 2
    assert "folders and files mixed" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_merge(tmp_path / "out", empty) == 2
    assert "found no results, baseline or calibration JSON" in capsys.readouterr().err
    assert run_merge(folder / "out", folder) == 2
    assert "inside SHARD" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{")
    assert run_merge(tmp_path / "o.json", tmp_path / "broken.json") == 1
    assert "not valid JSON" in capsys.readouterr().out
