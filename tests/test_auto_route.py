"""benchmarks/auto_route.py's crossover: for each row count, the shortest context from which
the second backend stays the faster."""

from __future__ import annotations

from benchmark_scripts import benchmark_script


def test_the_crossover_is_where_the_second_backend_wins_from_on() -> None:
    with benchmark_script("auto_route") as script:
        times = {
            (8, 512): (5.0, 6.0),
            (8, 2048): (9.0, 8.0),
            (8, 8192): (30.0, 20.0),
            (64, 512): (10.0, 12.0),
            (64, 2048): (20.0, 19.0),  # a win that the longer context takes back
            (64, 8192): (60.0, 61.0),
            (256, 512): (40.0, 30.0),
            (256, 2048): (90.0, 80.0),
        }
        assert script.crossover(times) == {8: 2048, 64: None, 256: 512}
