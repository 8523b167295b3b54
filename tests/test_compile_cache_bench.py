"""benchmarks/compile_cache.py's choice of runs (`--runs`): by name, in the bench's order, each
warm run with the cold run that fills its caches; no GPU, no child process."""
import pytest

from benchmarks.compile_cache import chosen

RUNS = [("inductor cold", {"a": "1"}), ("inductor warm", {"a": "1"}), ("k31c cold", {"b": "2"}),
        ("k31c warm", {"b": "2"}), ("k31c warm (fresh Triton cache)", {"b": "3"})]


def test_runs_are_picked_by_name_in_the_bench_order():
    assert chosen(RUNS, None) == RUNS
    assert chosen(RUNS, "k31c warm, k31c cold") == RUNS[2:4]
    assert chosen(RUNS, "k31c cold") == [RUNS[2]]


@pytest.mark.parametrize("names, says", [("k31c warm", "need(s) the cold run"),
                                         ("k31c warm (fresh Triton cache),inductor cold", "need(s) the cold run"),
                                         ("k31c cold,k31c hot", "unknown ['k31c hot']"),
                                         (" , ", "unknown nothing")])
def test_a_bad_choice_is_refused_naming_it(names, says):
    with pytest.raises(SystemExit, match=None) as e:
        chosen(RUNS, names)
    assert says in str(e.value)
