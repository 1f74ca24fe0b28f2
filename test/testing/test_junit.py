"""JUnit reports: per-rank paths, outcomes read from real pytest reports, merge over ranks."""

from physicsnemo_foldcp.testing.junit import (
    Case,
    count_outcomes,
    first_failure,
    merge_outcomes,
    read_cases,
    read_reports,
)
from physicsnemo_foldcp.testing.progress import PROGRESS_DIR_ENV, read_progress

pytest_plugins = ["pytester"]

OUTCOMES_FILE = """
import pytest

@pytest.fixture
def broken_setup():
    raise RuntimeError("setup broke")

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

def test_skips():
    pytest.skip("not here")

@pytest.mark.xfail(reason="known")
def test_xfails():
    assert False

def test_errors_in_setup(broken_setup):
    pass

def test_fails_then_errors_in_teardown(broken_teardown):
    assert False, "call broke"
"""


def test_a_real_report_counts_each_test_once(pytester):
    pytester.makepyfile(test_outcomes=OUTCOMES_FILE)
    pytester.runpytest("-p", "no:cacheprovider", "--junitxml=report.xml")
    cases = read_cases(pytester.path / "report.xml")
    by_test = {}
    for case in cases:
        by_test.setdefault(case.test.rsplit(".", 1)[-1], []).append(case.outcome)
    assert by_test == {
        "test_passes": ["passed"],
        "test_fails": ["failed"],
        "test_skips": ["skipped"],
        "test_xfails": ["skipped"],
        "test_errors_in_setup": ["failed"],
        "test_fails_then_errors_in_teardown": ["failed", "failed"],
    }
    failure = next(c for c in cases if c.test.endswith(".test_fails"))
    assert "one is not two" in failure.message
    found, missing = read_reports(str(pytester.path / "report.xml"), ranks=[0])
    assert missing == []
    assert count_outcomes(merge_outcomes(found)) == {"passed": 1, "failed": 3, "skipped": 2}


def test_a_test_fails_if_it_fails_on_any_rank_or_is_missing_from_one():
    ranks = {
        0: [Case("t.ok", "passed"), Case("t.one_rank", "passed"), Case("t.skip", "skipped")],
        1: [Case("t.ok", "passed"), Case("t.one_rank", "failed"), Case("t.skip", "passed")],
        2: [Case("t.ok", "passed"), Case("t.one_rank", "passed"), Case("t.skip", "passed")],
    }
    ranks[0].append(Case("t.skip_here_fail_there", "skipped"))
    ranks[1].append(Case("t.skip_here_fail_there", "failed"))
    ranks[2].append(Case("t.skip_here_fail_there", "passed"))
    ranks[0].append(Case("t.rank0_only", "passed"))
    merged = merge_outcomes(ranks)
    assert merged == {
        "t.ok": "passed",
        "t.one_rank": "failed",
        "t.skip": "skipped",
        "t.skip_here_fail_there": "failed",
        "t.rank0_only": "failed",
    }
    assert count_outcomes(merged) == {"passed": 1, "failed": 3, "skipped": 1}


def test_the_first_failure_is_the_earliest_in_test_order_over_the_ranks():
    ranks = {
        0: [Case("t.a", "passed"), Case("t.b", "passed"), Case("t.c", "failed", "echo")],
        1: [Case("t.a", "passed"), Case("t.b", "failed", "root cause"), Case("t.c", "failed")],
        2: [Case("t.a", "passed"), Case("t.b", "failed", "same place"), Case("t.c", "passed")],
    }
    assert first_failure(ranks) == (1, Case("t.b", "failed", "root cause"))
    assert first_failure({0: [Case("t.a", "passed"), Case("t.s", "skipped")]}) is None
    assert first_failure({}) is None


def test_missing_and_unreadable_reports_are_named(tmp_path):
    (tmp_path / "r0.xml").write_text('<testsuites><testsuite><testcase classname="t" name="a"/>')
    (tmp_path / "r1.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="a"/></testsuite></testsuites>'
    )
    found, missing = read_reports(str(tmp_path / "r{rank}.xml"), ranks=[0, 1, 2])
    assert count_outcomes(merge_outcomes(found)) == {"passed": 1, "failed": 0, "skipped": 0}
    assert missing == [0, 2]


def test_the_plugin_writes_one_report_and_one_progress_file_per_rank(pytester, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(pytester.path / "progress"))
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    result = pytester.runpytest(
        "-p", "physicsnemo_foldcp.testing.plugin", "-p", "no:cacheprovider",
        "--junitxml=reports/rank{rank}.xml",
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    assert sorted(p.name for p in (pytester.path / "reports").iterdir()) == ["rank3.xml"]
    assert [c.outcome for c in read_cases(pytester.path / "reports" / "rank3.xml")] == ["passed"]
    assert read_progress(pytester.path / "progress") == {3: "finished"}
