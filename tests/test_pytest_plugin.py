"""The ``raycoll`` pytest plugin, run the way users meet it: on a user's own test files.

Uses pytest's ``pytester``: in-process runs share this session's Ray (the plugin must reuse it
and leave it running); subprocess runs start their own small Ray (the plugin must start it
only when a fixture asks, and shut it down at the end).
"""

from __future__ import annotations

import ray
import pytest

pytest_plugins = ["pytester"]

USER_TESTS = '''
import numpy as np
import ray
import raycoll


def test_plain_tests_do_not_start_ray():
    assert not ray.is_initialized()


def average(rank, offset):
    t = np.full(3, float(rank) + offset)
    raycoll.all_reduce(t, op=raycoll.ReduceOp.AVG)
    return t.tolist()


def test_average(raycoll_ranks):
    assert raycoll_ranks.run(average, 3, 10.0) == [[11.0] * 3] * 3


def test_settings_come_from_ini(raycoll_ray, raycoll_ranks):
    assert ray.cluster_resources()["CPU"] == 2
    assert raycoll_ranks.max_world_size == 3
'''

RECORD_SHUTDOWN = '''
import pathlib


def pytest_sessionfinish(session):
    import ray
    pathlib.Path("ray_after_session.txt").write_text(str(ray.is_initialized()))
'''


@pytest.mark.timeout(240)
def test_user_suite_in_a_fresh_process_starts_and_stops_its_own_ray(pytester):
    pytester.makeini("[pytest]\nraycoll_num_cpus = 2\nraycoll_max_world_size = 3\n")
    pytester.makeconftest(RECORD_SHUTDOWN)
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=200)
    result.assert_outcomes(passed=3)
    assert (pytester.path / "ray_after_session.txt").read_text() == "False"


@pytest.mark.timeout(180)
def test_in_process_suite_reuses_the_running_ray_and_leaves_it_running(pytester, ranks):
    pytester.makeini("[pytest]\nraycoll_max_world_size = 2\n")
    pytester.makepyfile(test_user='''
import numpy as np
import raycoll

def total(rank):
    t = np.array([rank + 1.0])
    raycoll.all_reduce(t)
    return float(t[0])

def test_total(raycoll_ranks):
    assert raycoll_ranks.run(total, 2) == [3.0, 3.0]
''')
    # this module is not importable in the actors: the fixture ships it by value
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert ray.is_initialized()
    assert ranks.run(lambda rank: rank * 2, 2) == [0, 2]


def test_fixtures_are_listed_with_their_docs(pytester):
    result = pytester.runpytest("--fixtures", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines([
        "*raycoll_ranks -- *pytest_plugin.py*",
        "*raycoll_ranks.run(fn, world_size, *args)*",
        "*raycoll_ray ?session scope? -- *pytest_plugin.py*",
        "*small local Ray*",
    ])
    disabled = pytester.runpytest("--fixtures", "-p", "no:raycoll", "-p", "no:cacheprovider")
    assert "raycoll_ranks" not in disabled.stdout.str()


@pytest.mark.timeout(120)
def test_without_autoload_the_plugin_loads_by_module_name(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    plain = pytester.runpytest_subprocess("--fixtures", "-p", "no:cacheprovider", timeout=100)
    assert "raycoll_ranks" not in plain.stdout.str()
    loaded = pytester.runpytest_subprocess("--fixtures", "-p", "raycoll.pytest_plugin",
                                           "-p", "no:cacheprovider", timeout=100)
    loaded.stdout.fnmatch_lines(["*raycoll_ranks -- *pytest_plugin.py*"])


def test_a_bad_ini_value_is_a_usage_error_naming_the_option(pytester):
    pytester.makeini("[pytest]\nraycoll_num_cpus = many\n")
    pytester.makepyfile(test_user="def test_it(raycoll_ray):\n    pass\n")
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*raycoll_num_cpus must be a positive integer, got 'many'*"])
