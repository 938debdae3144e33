"""bench idle: the same work's CPU back to back and after sleeps."""

import json

from bench import idle


def test_python_calls_make_as_many_calls_as_asked():
    parts = [idle._Part(50) for _ in range(20)]
    idle.python_calls(parts, 1000)
    assert sum(p.count for p in parts) == 1000


def test_every_work_and_gap_gets_a_ratio(capsys):
    idle.main(["--rounds", "1", "--iterations", "2", "--calls", "50", "--floats", "64"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures.pop("bench") == "idle"
    gaps = [g for g in idle.GAPS_MS if g]
    assert sorted(figures) == sorted(f"{w}_after_{g:g}ms_vs_back_to_back" for w in ("python", "torch") for g in gaps)
    assert all(v > 0 for v in figures.values())
