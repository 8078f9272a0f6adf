"""The plugin's command line, ini keys and markers, through an inner pytest run. None of these runs starts a server:
tier-marked tests here are skipped by the tier check, before the device is looked at."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from pytest_vllm_mem.settings import OPTIONS, Settings, UsageError

TIER_TESTS = """
import pytest

@pytest.mark.vllm_tier("24gb")
def test_needs_24gb():
    pass

@pytest.mark.vllm_tier(max="16gb")
def test_small_cards_only():
    pass

def test_plain():
    pass
"""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "-rs", *args)


def assert_usage_error(result: pytest.RunResult, *fragments: str) -> str:
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    output = result.stdout.str() + "\n" + result.stderr.str()
    assert "Traceback" not in output
    for fragment in fragments:
        assert fragment in output, fragment
    return output


def test_bad_gpu_tier_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner_a="def test_a(): pass")
    result = run(pytester, "--vllm-gpu=huge")
    assert_usage_error(result, "--vllm-gpu='huge'", "is not a GPU memory tier", "24gb", "gib", "auto")


def test_a_gate_level_without_a_t_table_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner_a="def test_a(): pass")
    assert_usage_error(
        run(pytester, "--vllm-gate-alpha=0.03"), "--vllm-gate-alpha='0.03'", "accepted values are 0.05, 0.025, 0.01"
    )
    pytester.makeini("[pytest]\nvllm_gate_alpha = 5%\n")
    assert_usage_error(run(pytester), "ini vllm_gate_alpha='5%'", "expected a number", "0.05, 0.025 or 0.01")
    pytester.makeini("[pytest]\nvllm_gate_alpha = 0.01\n")
    run(pytester).assert_outcomes(passed=1)


def test_confirmation_can_be_switched_off_with_0_as_its_help_says(pytester: pytest.Pytester) -> None:
    # The help lists "0 (off)"; the generic "must be greater than 0" check refused it (found through a stub suite).
    pytester.makepyfile(test_inner_a="def test_a(): pass")
    run(pytester, "--vllm-confirm-sessions=0").assert_outcomes(passed=1)
    assert_usage_error(
        run(pytester, "--vllm-confirm-sessions=4"), "--vllm-confirm-sessions='4'", "accepted values are 0, 1, 2, 3"
    )
    assert_usage_error(run(pytester, "--vllm-confirm-sessions=-1"), "accepted values are 0, 1, 2, 3")


def test_the_gate_levels_offered_are_those_the_t_table_has() -> None:
    from pytest_vllm_mem.baseline.noise import ALPHAS
    from pytest_vllm_mem.settings import OPTIONS

    [option] = [item for item in OPTIONS if item.name == "vllm_gate_alpha"]
    assert option.choices == ALPHAS and option.default in ALPHAS


def test_bare_number_tier_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner_a="def test_a(): pass")
    assert_usage_error(run(pytester, "--vllm-gpu=24"), "--vllm-gpu='24'", "bare number")


def test_unknown_tolerance_metric_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner_a="def test_a(): pass")
    result = run(pytester, "--vllm-tolerance", "bogus=5%")
    assert_usage_error(
        result,
        "--vllm-tolerance",
        "unknown metric 'bogus'",
        "Known metrics:",
        "output_throughput",
        "load_peak_memory",
        "ttft_p99",
    )


def test_bad_tolerance_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner_a="def test_a(): pass")
    result = run(pytester, "--vllm-tolerance", "output_throughput=fast")
    assert_usage_error(result, "'fast'", "output_throughput", "percentage")


def test_bad_tolerance_in_the_ini_names_the_ini_key(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nvllm_tolerance = bogus=5%\n")
    pytester.makepyfile(test_inner_a="def test_a(): pass")
    assert_usage_error(run(pytester), "ini vllm_tolerance", "unknown metric 'bogus'")


@pytest.mark.parametrize(
    ("option", "fragment"),
    [
        ("--vllm-max-servers=0", "must be greater than 0"),
        ("--vllm-startup-timeout=soon", "expected a number"),
    ],
)
def test_bad_numbers_are_usage_errors(pytester: pytest.Pytester, option: str, fragment: str) -> None:
    pytester.makepyfile(test_inner_a="def test_a(): pass")
    assert_usage_error(run(pytester, option), option.split("=")[0], fragment)


def test_bad_tier_marker_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner_a="""
        import pytest

        @pytest.mark.vllm_tier("huge")
        def test_a():
            pass
    """
    )
    assert_usage_error(run(pytester, "--vllm-gpu=24gb"), "@pytest.mark.vllm_tier on test_inner_a.py::test_a", "'huge'")


def test_tier_markers_skip_with_both_tiers_named(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner_tiers=TIER_TESTS)
    result = run(pytester, "--vllm-gpu=8gb", "-k", "needs_24gb or plain")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*needs the 24gb tier; this run is on the 8gb tier*"])


def test_max_tier_marker_skips_larger_tiers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner_tiers=TIER_TESTS)
    result = run(pytester, "--vllm-gpu=24gb", "-k", "small_cards_only or plain")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*only for tiers up to 16gb; this run is on the 24gb tier*"])


def test_markers_are_registered(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner_a="""
        import pytest

        @pytest.mark.vllm_tier("24gb")
        @pytest.mark.vllm_tolerance(output_throughput="20%")
        def test_a():
            pass
    """
    )
    result = run(pytester, "--strict-markers", "--vllm-gpu=8gb")
    result.assert_outcomes(skipped=1)
    markers = run(pytester, "--markers")
    markers.stdout.fnmatch_lines(
        ["@pytest.mark.vllm_tier(min=None, *, max=None):*", "@pytest.mark.vllm_tolerance(**metrics):*"]
    )


def test_marker_selection(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner_tiers=TIER_TESTS)
    # small_cards_only would pass the tier check on 8gb and then depend on this machine's memory: left out.
    result = run(pytester, "--vllm-gpu=8gb", "-m", "vllm_tier", "-k", "not small_cards_only")
    result.assert_outcomes(skipped=1, deselected=2)
    result = run(pytester, "--vllm-gpu=8gb", "-m", "not vllm_tier")
    result.assert_outcomes(passed=1, deselected=2)


def test_help_lists_every_option(pytester: pytest.Pytester) -> None:
    result = run(pytester, "--help")
    assert result.ret == pytest.ExitCode.OK
    output = result.stdout.str()
    for option in OPTIONS:
        assert option.flag in output, option.flag
        assert f"{option.name} (" in output, option.name  # the ini key
    assert "output_throughput=15%" in output


def test_ini_value_applies_without_the_option(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nvllm_gpu = 8gb\n")
    pytester.makepyfile(test_inner_tiers=TIER_TESTS)
    result = run(pytester, "-k", "needs_24gb")
    result.assert_outcomes(skipped=1, deselected=2)
    result.stdout.fnmatch_lines(["*needs the 24gb tier; this run is on the 8gb tier*"])


def test_command_line_beats_the_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nvllm_gpu = 8gb\n")
    pytester.makepyfile(test_inner_tiers=TIER_TESTS)
    result = run(pytester, "-k", "needs_24gb", "--vllm-gpu=16gb")
    result.assert_outcomes(skipped=1, deselected=2)
    result.stdout.fnmatch_lines(["*needs the 24gb tier; this run is on the 16gb tier*"])


def test_bad_tier_in_the_ini_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nvllm_gpu = big\n")
    pytester.makepyfile(test_inner_a="def test_a(): pass")
    assert_usage_error(run(pytester), "'big'", "is not a GPU memory tier")


def test_a_run_without_servers_prints_no_vllm_summary(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner_a="def test_a(): pass")
    result = run(pytester, "--vllm-gpu=24gb")
    result.assert_outcomes(passed=1)
    assert "vLLM memory and serving" not in result.stdout.str()


# ---- the option table: one place ------------------------------------------------------------------------------------

KIND_TYPES = {"str": str, "bool": bool, "float": float, "int": int, "path": Path}


def test_every_settings_field_is_an_option_of_its_annotated_type(tmp_path: Path) -> None:
    """Settings fields are the table: each is an option, and its built-in default converts to the field's type."""
    assert [item.name for item in OPTIONS] == [field.name for field in dataclasses.fields(Settings)]
    hints = typing.get_type_hints(Settings)
    defaults = Settings.from_values({}, tmp_path)
    for item in OPTIONS:
        allowed = typing.get_args(hints[item.name]) or (hints[item.name],)
        assert KIND_TYPES[item.kind] in allowed, item.name
        value = getattr(defaults, item.name)
        assert (value is None and type(None) in allowed) or isinstance(value, KIND_TYPES[item.kind]), item.name


def test_outside_pytest_values_convert_like_command_line_values(tmp_path: Path) -> None:
    settings = Settings.from_values({"vllm_max_servers": "3", "vllm_log_dir": "logs", "vllm_strict": True}, tmp_path)
    assert settings.vllm_max_servers == 3 and settings.vllm_log_dir == tmp_path / "logs" and settings.vllm_strict
    assert settings.vllm_baseline == tmp_path / ".vllm-mem" / "baselines.json"
    with pytest.raises(UsageError, match="--vllm-max-servers='0': must be greater than 0"):
        Settings.from_values({"vllm_max_servers": "0"}, tmp_path)
    with pytest.raises(TypeError, match="vllm_no_such"):
        Settings.from_values({"vllm_no_such": 1}, tmp_path)


def test_the_plugin_usage_error_is_its_own_class() -> None:
    """pytest.UsageError is final; the plugin's is turned into it at the hooks (the exit-4 tests above)."""
    assert not issubclass(UsageError, pytest.UsageError)


ORDER_CONFTEST = """
from pathlib import Path
import pytest

SEEN = []

@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call":
        SEEN.append(type(report.longrepr).__name__)
    return report

def pytest_sessionfinish(session):
    Path("order.txt").write_text(",".join(SEEN) + ";" + str(Path("results.json").exists()))
"""


def test_the_session_hooks_keep_their_order_around_a_users_conftest(pytester: pytest.Pytester) -> None:
    """The session's hooks are methods of a plugin object registered at configure, after the user's conftest; as
    the module plugin they were, they still run inside the user's wrappers (which see the one-paragraph message the
    plugin puts in the report) and after the user's session-finish hook (which runs before the reports exist)."""
    pytester.makeconftest(ORDER_CONFTEST)
    pytester.makepyfile(
        test_usage="""
from pytest_vllm_mem.settings import UsageError

def test_bad_input():
    raise UsageError("the input X is not accepted: pass Y")
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--vllm-results=results.json")
    result.assert_outcomes(failed=1)
    assert (pytester.path / "order.txt").read_text() == "str;False"
    assert (pytester.path / "results.json").exists()
    assert "Traceback" not in result.stdout.str()
