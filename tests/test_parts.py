"""`make gpu-pytest PART=k/n`: the parts of a suite cover every test once, whole files each."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
CONFTEST = Path(__file__).with_name("conftest.py").read_text()


@pytest.fixture
def suite(pytester):
    """Five test files of two tests each, under the suite's own conftest.py."""
    pytester.makeconftest(CONFTEST)
    for name in "abcde":
        pytester.makepyfile(**{f"test_{name}": "def test_one():\n    pass\n\n"
                                               "def test_two():\n    pass\n"})
    return pytester


def collected(suite, *args: str) -> list[str]:
    result = suite.runpytest_inprocess("--collect-only", "-q", *args)
    return [line for line in result.outlines if "::" in line]


def test_the_parts_split_the_suite_by_file_and_cover_it_once(suite):
    whole = collected(suite)
    parts = [collected(suite, f"--part={k}/2") for k in (1, 2)]
    assert len(whole) == 10 and sorted(parts[0] + parts[1]) == sorted(whole)  # each test once
    files = [{t.split("::")[0] for t in p} for p in parts]
    assert len(files[0]) == 3 and len(files[1]) == 2  # whole files: a module fixture runs once


def test_a_bad_part_is_a_one_line_usage_error(suite, capsys):
    for bad in ("0/2", "3/2", "half"):
        result = suite.runpytest_inprocess("--collect-only", "-q", f"--part={bad}")
        err = capsys.readouterr().err + result.stderr.str()
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert f"ERROR: --part={bad}: give K/N" in err and "Traceback" not in err
