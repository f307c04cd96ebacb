"""benchmarks/load_balance.py: the simulated dealing against cases with a known answer."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "load_balance.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("load_balance_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_saturated_group_means_nothing_to_balance(bench) -> None:
    now, balanced, spread = bench.expected_passes(48, 24, 8, 9, z=0.0, trials=50)
    assert now == balanced == math.ceil(48 * 24 / 8 / 9) and spread == 0


def test_all_saturated_means_no_pass(bench) -> None:
    assert bench.expected_passes(4, 8, 2, 8, z=1.0, trials=50) == (0.0, 0.0, 0.0)


def test_one_rank_is_always_balanced(bench) -> None:
    now, balanced, spread = bench.expected_passes(8, 8, 1, 5, z=0.4, trials=200)
    assert now == balanced and spread == 0


def test_two_groups_over_two_ranks_match_the_exact_count(bench) -> None:
    """M=2, K=2, R=2, micro-batch 1, one group saturated for sure: the two kept samples land on the
    same rank in 2 of the C(4,2)=6 equally likely deals (then 2 passes, else 1); balanced is 1."""
    # z close to 1 for group 0 only is not expressible; use z = 0.5 and the exact mixture instead:
    # both kept (prob 1/4): every deal gives 2 per rank -> 2 passes; one kept (1/2): 2 passes with
    # prob 1/3, else 1; none (1/4): 0.
    now, balanced, _ = bench.expected_passes(2, 2, 2, 1, z=0.5, trials=200_000, seed=1)
    exact_now = 0.25 * 2 + 0.5 * (2 / 3 * 1 + 1 / 3 * 2)
    exact_balanced = 0.25 * 2 + 0.5 * 1
    std = np.sqrt(0.25 * 4 + 0.5 * (2 / 3 + 4 / 3) - exact_now**2)
    assert now == pytest.approx(exact_now, abs=5 * std / np.sqrt(200_000))
    assert balanced == pytest.approx(exact_balanced, abs=5 * 1.0 / np.sqrt(200_000))
