"""``poise bench packed``'s pure parts: a run's figures from its report, poise over naive, the
Markdown table docs/balancing.md quotes (the jobs themselves are real ``poise train`` runs)."""

import json

import pytest

from poise.bench import packed


def _report(packer: str, rank_speed: str, balance: float, tokens_per_s: float) -> dict:
    return {"balance": balance, "balance_per_step": [0.5] * 10 + [balance] * 10,
            "throughput_tokens_per_s": tokens_per_s, "eval_loss": 3.21, "median_step_s": 0.8,
            "balance_ceiling_last_half": 0.97, "config": {"emulate": {"rank_speed": rank_speed}},
            "packing": {"packer": packer, "plan_ms_per_step": 0.8, "row_tokens": 2048, "planned_steps": 20}}


def test_a_recorded_result_gives_the_table_and_the_ratios():
    rows = [packed.run_row("a-naive", _report("naive", "", 0.8, 1000.0), settle_steps=10),
            packed.run_row("b-poise", _report("poise", "", 0.96, 1250.0), settle_steps=10),
            packed.run_row("c-naive-slow", _report("naive", "1:0.5", 0.5, 600.0), settle_steps=10),
            packed.run_row("d-poise-slow", _report("poise", "1:0.5", 0.94, 900.0), settle_steps=10)]
    assert rows[0]["rank_speed"] == "equal" and rows[2]["rank_speed"] == "1:0.5"
    assert rows[1]["balance_settled"] == pytest.approx(0.96)
    assert rows[1]["plan_share"] == pytest.approx(0.001)  # 0.8 ms of an 800 ms step
    ratios = packed.compare(rows)
    assert [r["run"] for r in ratios] == ["poise / naive (equal)", "poise / naive (1:0.5)"]
    assert ratios[0]["tokens_per_s"] == pytest.approx(1.25) and ratios[1]["balance"] == pytest.approx(1.88)
    result = {"steps": 20, "row_tokens": 2048, "rows": 4, "nproc": 2, "settle_steps": 10, "runs": rows,
              "ratios": ratios}
    text = packed.markdown_table(result)
    assert "| b-poise | equal | 0.960 | 0.960 | 0.970 | 1,250 | 3.210 | 800 | 0.80 | 0.10% |" in text
    assert "| **poise / naive (1:0.5)** | | **1.88x** | | | **1.50x** | **1.000x** | | | |" in text
    packed.table(result)  # the terminal's tables print from the same dict


def test_the_balancing_page_quotes_its_results_file_whole():
    """One figure per claim: docs/balancing.md's packed table is the one the bench wrote into
    docs/results/packed.json (a page edited by hand, or a file replaced, fails here)."""
    from tests.conftest import ROOT

    data = json.loads((ROOT / "docs" / "results" / "packed.json").read_text())
    assert data["bench"] == "packed"
    assert packed.markdown_table(data) in (ROOT / "docs" / "balancing.md").read_text()
