"""Error cases (cases_errors.py) on 1, 2 and 3 ranks: one job per rank count."""

import pytest

import cases_errors

NAMES = cases_errors.CASES.names()


@pytest.mark.parametrize("np", [1, 2, 3])
@pytest.mark.parametrize("case", NAMES)
def test_case(case_runs, case, np):
    case_runs.get("cases_errors", np).check(case)
