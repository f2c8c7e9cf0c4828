"""One figure per claim (issue 59): a figure the README or a page quotes from a bench's results
file agrees with that file, wherever it is quoted.

``make demo`` writes docs/results/demo.json's figures; the README and the start page quote its
table whole (``poise.bench.demo.markdown_table``), and the README, the start page and the
balancing page quote its figures in prose, each with its setting. Their capability table's
no-settings row quotes ``poise bench auto``'s file, docs/results/bench-auto.json. A page edited by hand, or a
results file replaced without the pages, fails here, naming the page, the claim and both
figures. The decide page's table is checked the same way in tests/unit/test_bench_auto.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from poise.bench import auto, demo
from tests.conftest import ROOT

RESULTS = ROOT / "docs" / "results" / "demo.json"
PAGES = ["README.md", "docs/index.md", "docs/balancing.md", "docs/benchmarks.md", "docs/compression.md"]


def results() -> dict[str, Any]:
    return json.loads(RESULTS.read_text())


def run(data: dict[str, Any], name: str, key: str) -> float:
    return next(float(r[key]) for r in data["runs"] if r["name"] == name)


def ratio(data: dict[str, Any], of: str, over: str, key: str) -> float:
    return next(float(r[key]) for r in data["ratios"] if (r["of"], r["over"]) == (of, over))


def text(page: str) -> str:
    """The page with every run of whitespace as one space (a claim may be wrapped anywhere)."""
    return " ".join((ROOT / page).read_text().split())


TOKENS, BALANCE, BYTES = "throughput_tokens_per_s", "balance", "bytes_communicated_per_step"


@dataclass(frozen=True)
class Claim:
    """A figure quoted in prose: ``pattern``'s groups must read ``figures(results)`` in every page
    that has it, and the pages of ``required`` must have it."""

    what: str
    pattern: str
    figures: Callable[[dict[str, Any]], tuple[str, ...]]
    required: tuple[str, ...]


TOP = ("README.md", "docs/index.md")
CLAIMS = [
    Claim("auto's tokens/s over static's", r"gives (\d+\.\d\d)x static's tokens/s",
          lambda d: (f"{ratio(d, 'auto', 'static', TOKENS):.2f}",), TOP),
    Claim("what length bucketing adds", r"adds a further (\d+\.\d\d)x in tokens/s, (\d+\.\d\d)x static's in all",
          lambda d: (f"{ratio(d, 'dynamic', 'auto', TOKENS):.2f}", f"{ratio(d, 'dynamic', 'static', TOKENS):.2f}"),
          TOP),
    Claim("auto's eval loss is DDP's", r"DDP's to the third digit \((\d+\.\d{3})\)",
          lambda d: (f"{run(d, 'static', 'eval_loss'):.3f}",), TOP),
    Claim("PowerSGD's bytes and tokens/s over the slow link",
          r"PowerSGD sends (\d+\.\d\d)x DDP's bytes per step .{0,60}?for (\d+\.\d\d)x its tokens/s at the same eval "
          r"loss \((\d+\.\d{3}) against (\d+\.\d{3})\)",
          lambda d: (f"{ratio(d, 'compressed', 'ddp', BYTES):.2f}", f"{ratio(d, 'compressed', 'ddp', TOKENS):.2f}",
                     f"{run(d, 'compressed', 'eval_loss'):.3f}", f"{run(d, 'ddp', 'eval_loss'):.3f}"), TOP),
    Claim("the capability table's balancing row",
          r"`dynamic` (\d+\.\d\d)× static's tokens/s, `auto` (\d+\.\d\d)×; balance (\d\.\d{3}) and (\d\.\d{3}) "
          r"against static's (\d\.\d{3})",
          lambda d: (f"{ratio(d, 'dynamic', 'static', TOKENS):.2f}", f"{ratio(d, 'auto', 'static', TOKENS):.2f}",
                     f"{run(d, 'dynamic', BALANCE):.3f}", f"{run(d, 'auto', BALANCE):.3f}",
                     f"{run(d, 'static', BALANCE):.3f}"), TOP),
    Claim("the capability table's compression row",
          r"PowerSGD (\d+\.\d\d)× DDP's bytes per step, (\d+\.\d\d)× its tokens/s",
          lambda d: (f"{ratio(d, 'compressed', 'ddp', BYTES):.2f}", f"{ratio(d, 'compressed', 'ddp', TOKENS):.2f}"),
          TOP),
    Claim("the balancing page's rows", r"\| plain DDP \(static sharding\) \| (\S+) \| (\S+) \| (\S+) \| 1\.00x \| "
          r"\| poise, no settings \(`auto`\) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| "
          r"\| poise `dynamic` \(\+ length bucketing\) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \|",
          lambda d: (*_row(d, "static"), *_row(d, "auto"), f"{ratio(d, 'auto', 'static', TOKENS):.2f}x",
                     *_row(d, "dynamic"), f"{ratio(d, 'dynamic', 'static', TOKENS):.2f}x"), ("docs/balancing.md",)),
    Claim("the balancing page's eval losses", r"its eval loss (\d\.\d{3}) against static's and auto's (\d\.\d{3})",
          lambda d: (f"{run(d, 'dynamic', 'eval_loss'):.3f}", f"{run(d, 'static', 'eval_loss'):.3f}"),
          ("docs/balancing.md",)),
]


def _auto(scenario: str, run_name: str, key: str) -> float:
    """A figure of docs/results/bench-auto.json's summary (the decide page's table)."""
    data = json.loads((ROOT / "docs" / "results" / "bench-auto.json").read_text())
    rows = auto.summarize(data["runs"])
    return next(float(r[key]) for r in rows if (r["scenario"], r["run"]) == (scenario, run_name))


# the README's and the start page's "no settings" row quotes poise bench auto's file
AUTO_CLAIM = Claim(
    "the capability table's no-settings row",
    r"nothing to fix (\d+\.\d\d)× DDP's time to its eval loss .{0,60}?rank 1 at half speed (\d+\.\d\d)× at "
    r"DDP's tokens "
    r"\(length bucketing (\d+\.\d\d)×, (\d+\.\d\d)× the tokens\); half speed with variable lengths (\d+\.\d\d)×",
    lambda _: (f"{_auto('S1', 'auto', 'speedup_vs_ddp'):.2f}", f"{_auto('S2', 'auto', 'speedup_vs_ddp'):.2f}",
               f"{_auto('S2', 'dynamic', 'speedup_vs_ddp'):.2f}", f"{_auto('S2', 'dynamic', 'tokens_vs_ddp'):.2f}",
               f"{_auto('S9', 'auto', 'speedup_vs_ddp'):.2f}"), TOP)
CLAIMS.append(AUTO_CLAIM)


def _packed(name: str, key: str) -> float:
    """A run's figure in docs/results/packed.json (``poise bench packed``)."""
    data = json.loads((ROOT / "docs" / "results" / "packed.json").read_text())
    return next(float(r[key]) for r in data["runs"] if r["run"] == name)


# the capability tables' packed-sequences row quotes poise bench packed's file
CLAIMS.append(Claim(
    "the capability table's packed-sequences row",
    r"rank 1 at half speed balance (\d\.\d{3}) \(from step 10\) against naive packing's (\d\.\d{3}), "
    r"(\d+\.\d\d)× its tokens/s; equal ranks (\d+\.\d\d)×",
    lambda _: (f"{_packed('d-poise-slow', 'balance_settled'):.3f}", f"{_packed('c-naive-slow', 'balance_settled'):.3f}",
               f"{_packed('d-poise-slow', 'tokens_per_s') / _packed('c-naive-slow', 'tokens_per_s'):.2f}",
               f"{_packed('b-poise', 'tokens_per_s') / _packed('a-naive', 'tokens_per_s'):.2f}"), TOP))


def _row(data: dict[str, Any], name: str) -> tuple[str, ...]:
    """A run's balance, idle share and tokens/s as the demo's table formats them."""
    fmt = {key: f for key, _, f in demo.METRICS}
    return tuple(fmt[key](run(data, name, key)) for key in (BALANCE, "idle_fraction", TOKENS))


@pytest.mark.timeout(60)
def test_the_demo_table_is_quoted_whole_wherever_it_is_quoted() -> None:
    table = demo.markdown_table(results())
    header = table.splitlines()[0]
    for page in PAGES:
        page_text = (ROOT / page).read_text()
        if page in TOP or header in page_text:
            assert table in page_text, f"{page}: the demo's table differs from docs/results/demo.json's:\n{table}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.what)
def test_each_figure_quoted_from_the_demo_agrees_with_its_file(claim: Claim) -> None:
    expected = claim.figures(results())
    for page in PAGES:
        found = [m.groups() for m in re.finditer(claim.pattern, text(page))]
        assert found or page not in claim.required, f"{page} no longer quotes {claim.what} (its pattern)"
        for groups in found:
            assert groups == expected, f"{page}: {claim.what} reads {groups}, docs/results/demo.json {expected}"


# Figures of the balancing and compression claims that no results file holds (a 150-step bench,
# several runs of a command): each claim is quoted from its file, with its setting, instead.
RETIRED = [r"2\.74\s*[x×] static", r"balance 0\.947", r"\b4[23]x fewer bytes"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pattern", RETIRED)
def test_no_page_quotes_a_figure_without_its_file(pattern: str) -> None:
    found = [page for page in PAGES if re.search(pattern, text(page))]
    assert not found, f"{pattern!r} in {found}: quote the claim from its results file"
