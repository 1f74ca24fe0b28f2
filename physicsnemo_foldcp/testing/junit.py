"""Test outcomes from pytest's JUnit XML reports, merged over the ranks of one run.

Under ``torchrun`` every rank runs the same pytest session, so each rank writes its own
report: ``--junitxml`` paths containing :data:`RANK_PLACEHOLDER` get the global rank
substituted by the pytest plugin (:func:`report_path`). A test counts once per run:
failed if it failed (or errored, in any phase) on any rank or is missing from a rank's
report, skipped if it was skipped on any rank and failed on none, passed otherwise.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

RANK_PLACEHOLDER = "{rank}"
OUTCOMES = ("passed", "failed", "skipped")
_SEVERITY = {"passed": 0, "skipped": 1, "failed": 2}
"""Merging ranks keeps the most severe outcome: a failure anywhere outranks a skip."""


def report_path(template: str, rank: int) -> str:
    """Substitute ``rank`` for :data:`RANK_PLACEHOLDER` in a ``--junitxml`` path."""
    return template.replace(RANK_PLACEHOLDER, str(rank))


@dataclass(frozen=True)
class Case:
    """One ``<testcase>`` of a report.

    Attributes
    ----------
    test : str
        ``classname.name`` (just ``name`` for collection errors), e.g.
        ``test.test_plan.test_split[4]``.
    outcome : str
        ``"passed"``, ``"failed"`` (a ``<failure>`` or ``<error>``) or ``"skipped"``
        (also xfail).
    message : str
        The failure, error or skip message; empty for a pass.
    """

    test: str
    outcome: str
    message: str = ""


def read_cases(path: str | os.PathLike[str]) -> list[Case]:
    """Read every ``<testcase>`` of one JUnit XML file, in file order.

    A test that failed in its call and again in teardown appears twice, as pytest writes it.

    Parameters
    ----------
    path : path
        A report written by ``pytest --junitxml``.

    Returns
    -------
    list[Case]
        One entry per ``<testcase>`` element.
    """
    cases = []
    for element in ET.parse(path).getroot().iter("testcase"):
        classname, name = element.get("classname", ""), element.get("name", "")
        test = f"{classname}.{name}" if classname else name
        outcome, message = "passed", ""
        for tag, meaning in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            found = element.find(tag)
            if found is not None:
                outcome, message = meaning, found.get("message", "")
                break
        cases.append(Case(test, outcome, message))
    return cases


def _worst(outcomes: Sequence[str]) -> str:
    return max(outcomes, key=_SEVERITY.__getitem__)


def merge_outcomes(cases_by_rank: Mapping[int, Sequence[Case]]) -> dict[str, str]:
    """One outcome per test over all ranks' reports.

    Parameters
    ----------
    cases_by_rank : Mapping[int, Sequence[Case]]
        Global rank -> that rank's cases (:func:`read_cases`).

    Returns
    -------
    dict[str, str]
        Test -> ``"passed"``, ``"failed"`` or ``"skipped"``, in first-seen order. A test
        absent from some rank's report is failed: every rank must run the same tests.
    """
    per_test: dict[str, dict[int, list[str]]] = {}
    for rank, cases in cases_by_rank.items():
        for case in cases:
            per_test.setdefault(case.test, {}).setdefault(rank, []).append(case.outcome)
    merged = {}
    for test, by_rank in per_test.items():
        if len(by_rank) < len(cases_by_rank):
            merged[test] = "failed"
        else:
            merged[test] = _worst([_worst(outcomes) for outcomes in by_rank.values()])
    return merged


def count_outcomes(outcomes: Mapping[str, str]) -> dict[str, int]:
    """Count merged outcomes: ``{"passed": n, "failed": n, "skipped": n}``."""
    counted = Counter(outcomes.values())
    return {outcome: counted.get(outcome, 0) for outcome in OUTCOMES}


def first_failure(cases_by_rank: Mapping[int, Sequence[Case]]) -> tuple[int, Case] | None:
    """The failure that came first in the run's test order, and the rank that reported it.

    Every rank runs the tests in the same order, so the earliest failed case over all
    reports is where the run first went wrong; later failures are often its echo (a
    broken process group fails every test after it).

    Parameters
    ----------
    cases_by_rank : Mapping[int, Sequence[Case]]
        Global rank -> that rank's cases (:func:`read_cases`).

    Returns
    -------
    tuple[int, Case] or None
        ``(rank, case)`` of the earliest failed case (lowest rank on a tie), or ``None``
        when no case failed.
    """
    earliest: tuple[int, int, Case] | None = None
    for rank, cases in sorted(cases_by_rank.items()):
        for position, case in enumerate(cases):
            if case.outcome == "failed":
                if earliest is None or position < earliest[0]:
                    earliest = (position, rank, case)
                break
    return None if earliest is None else (earliest[1], earliest[2])


def read_reports(template: str, ranks: Sequence[int]) -> tuple[dict[int, list[Case]], list[int]]:
    """Read every rank's report of one run.

    Parameters
    ----------
    template : str
        The ``--junitxml`` path given to every rank, with :data:`RANK_PLACEHOLDER`.
    ranks : Sequence[int]
        The global ranks that should have written a report.

    Returns
    -------
    found : dict[int, list[Case]]
        Rank -> its cases, for the reports that could be read.
    missing : list[int]
        Ranks whose report does not exist or cannot be parsed (a rank that was killed
        writes none).
    """
    found, missing = {}, []
    for rank in ranks:
        try:
            found[rank] = read_cases(report_path(template, rank))
        except (FileNotFoundError, ET.ParseError):
            missing.append(rank)
    return found, missing
