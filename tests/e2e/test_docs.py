"""Every command in README.md and docs/*.md is run, so that none goes stale (issue 18).

Commands are the lines of the pages' ```bash blocks (a trailing ``\\`` joins the next line; a
``<<'EOF'`` here-document runs with its body). Each one is, by the tables below:

- **run** as written, in a workspace of its page, after the page's earlier commands (a page
  reads top to bottom: ``runs/a`` of one command is there for the next), with the argument
  rewrites of :data:`REWRITES` applied in order (fewer steps, shorter samples: the same code
  paths in seconds). The command must exit 0.
- **run as a smaller variant** (:data:`VARIANTS`): the command makes what a later one reads
  (``runs/bench-codecs``) but takes minutes as written; the variant and its reason are listed.
- **checked, not run** (:data:`CHECKED`, with the reason: needs a second machine, takes many
  minutes, is this test suite itself...): its arguments are parsed by the poise CLI's own
  parser and, for ``poise train``/``pipeline`` (and a bench's flags after ``--``), resolved
  into a validated config, so a renamed flag or setting still fails here. A command that
  needs root, ``ip`` and ``tc`` (:data:`NEEDS_CLUSTER`) runs where they are available and is
  checked elsewhere, saying why.

Some commands must show more than an exit code of 0 (:data:`EXPECT`: ``make demo`` its table,
``compare.png`` and the diagnosis naming the slow rank).

Nothing else: a new command in a page is run by default, and every entry of the tables must
match a command of the pages (:func:`test_every_table_entry_matches_a_command`). Pages that
read another page's outputs name them in :data:`FROM_OTHER_PAGES`. Links between the pages
are checked too.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.harness import run_cli

pytestmark = pytest.mark.e2e

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_TIMEOUT_S = 420.0
# how long a test waits for its command: the commands of its page before it, and of another page
# running beside it, come first
COMMAND_WAIT_S = 840.0
# a cluster of this test's own: the docs' commands use the default name, which another job may hold
CLUSTER_NAME = f"docs{os.getpid() % 100000}"


@dataclass(frozen=True)
class Command:
    """One command of a page: its text as written (continuations joined) and where it is."""

    text: str
    page: str  # path relative to the repository root
    line: int

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def bare(self) -> str:
        """The text without its comment: the same command in two places, commented apart, is one."""
        return without_comment(self.text)


def extract_commands(page: Path) -> list[Command]:
    """The commands of ``page``'s ```bash blocks, in order (comment-only and blank lines dropped)."""
    commands: list[Command] = []
    lines = page.read_text().splitlines()
    rel = str(page.relative_to(ROOT))
    i, in_bash = 0, False
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            in_bash = not in_bash and line.strip() == "```bash"
            i += 1
            continue
        if not in_bash or not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        start, text = i + 1, line
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + lines[i].strip()
        heredoc = re.search(r"<<-?\s*'?(\w+)'?", text)
        if heredoc:
            body = []
            while i + 1 < len(lines) and lines[i + 1].strip() != heredoc.group(1):
                i += 1
                body.append(lines[i])
            i += 1  # the delimiter
            text = "\n".join([text, *body, heredoc.group(1)])
        commands.append(Command(text, rel, start))
        i += 1
    return commands


def without_comment(text: str) -> str:
    """The command without its trailing ``# comment`` (a ``#`` after a space, outside quotes;
    first line only: a here-document's body is kept as it is)."""
    first, *rest = text.split("\n")
    quote = ""
    for i, ch in enumerate(first):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or first[i - 1].isspace()):
            first = first[:i]
            break
    return "\n".join([first.rstrip(), *rest])


# -- what is not run, and why -----------------------------------------------------------

COVERED = "tests/e2e/test_bench_cli.py runs it at CI size"
# (pattern searched in the command, reason): parsed and resolved, not run
CHECKED: list[tuple[str, str]] = [
    (r"^make test$", "the whole test suite, of which this test is a part"),
    (r"--rdzv-endpoint (host0|10\.0\.0\.1):", "a job across real machines: it waits for the other one to join "
                                              "(tests/cluster runs multi-node jobs on the emulated cluster)"),
    (r"^(sudo \S*poise|poise) cluster down --all", "removes every poise cluster on the machine, other jobs' "
                                                   "included"),
    (r"^(python -m )?pip (install|wheel) ", "installs into the environment that runs this test: the extras it "
                                           "names are checked against pyproject.toml"),
    (r"^make venv$", "creates .venv, the environment this test runs in (make test makes it first)"),
    (r"^\. \.venv/bin/activate$", "activates .venv: this test already runs with its bin first on PATH"),
    (r"^srun torchrun ", "a SLURM job step across machines: torchrun's arguments are parsed by torch's own parser"),
    (r"^poise bench balance", f"six jobs of 150 steps; {COVERED}"),
    (r"^poise bench stragglers", "2 x 4 delay models x 3 seeds, many minutes; "
                                 "tests/e2e/test_bench_stragglers.py runs it at CI size"),
    (r"^poise bench codecs --kernels '' --task code-lm --steps 300 -- ", f"300-step runs of every codec; {COVERED}"),
    (r"^poise bench diagnose", "one 80-step job per injected cause; tests/e2e/test_diagnose_run_cli.py runs it "
                               "at CI size"),
    (r"^(sudo \S*poise|poise) bench faults", "a soak of many fault runs; tests/e2e/test_bench_faults.py runs a slice"),
    (r"^poise bench checkpoint", "seven 40-step jobs with checkpoints; tests/e2e/test_bench_cli.py checks its "
                                 "arguments, tests/e2e/test_restart.py the checkpoints"),
    (r"^poise bench partition", f"profiles, brute force over random costs and real pipelines; {COVERED}"),
    (r"^poise bench scaling", f"three real jobs; {COVERED}"),
    (r"^(sudo \S*poise|poise) bench network", "every codec over three emulated link rates, many minutes; "
                                              "tests/cluster/test_bench_network.py runs it at CI size"),
    (r"^(sudo \S*poise|poise) bench outer", "DDP, codecs and outer-step runs over shaped links, many minutes; "
                                            "tests/unit/test_bench_outer.py checks its arguments and tables"),
    (r"^(sudo \S*poise|poise) bench parallel", "seven jobs on the emulated cluster, about 20 minutes; "
                                               "tests/unit/test_bench_parallel.py checks its arguments and rows"),
    (r"^(sudo \S*poise|poise) bench plan", "45 jobs on the emulated cluster, about 21 minutes; "
                                           "tests/cluster/test_bench_plan.py runs it at CI size"),
    (r"^poise bench auto", "5 scenarios x 4 runs x 3 seeds of 150 steps, about an hour; "
                           "tests/unit/test_bench_auto.py checks its arguments, recovery and table"),
    (r"^poise train --task.packed true", "a 100-step packed job of 2,048-byte rows, minutes; tests/dist/test_packed.py "
                                         "trains packed rows through a session, tests/unit/test_packing.py the model"),
    (r"^poise bench packed", "four 40-step packed jobs of 2,048-byte rows, about 20 minutes; "
                             "tests/unit/test_bench_packed.py checks its table against docs/results/packed.json"),
]
# commands that need root, ip and tc: run where those are, checked elsewhere
NEEDS_CLUSTER = [r"^(sudo \S*poise|poise) cluster ", r"--cluster \d", r"^sudo "]
# (pattern, the smaller command run instead, why): it makes what a later command of its page reads
VARIANTS: list[tuple[str, str, str]] = [
    (r"^poise bench codecs .*--out runs/bench-codecs",
     "poise bench codecs --kernels '' --codecs none --steps 20 --out runs/bench-codecs",
     "the codecs.json `poise plan --codec-results` reads: one 2-step digits run, not every codec's on code-lm"),
]
# page -> paths it reads that another page's commands make there: (path, the page that makes it)
FROM_OTHER_PAGES: dict[str, list[tuple[str, str]]] = {
    "docs/train.md": [("runs/demo", "README.md")],
    "docs/diagnosis.md": [("runs/demo", "README.md")],
}


# -- what some commands must show besides exiting 0 -------------------------------------------


def _demo_shows_the_comparison(result: subprocess.CompletedProcess[str], workspace: Path) -> None:
    """``make demo``: the table of ratios (static, auto and dynamic with the slow rank: each over
    static, and dynamic over auto) and the line crediting the gain to its two causes, compare.png,
    the diagnosis naming the slow rank, and the slow-network comparison run where a cluster can
    be built (else one line saying why not)."""
    import json

    out = workspace / "runs" / "demo"
    for text in ("auto / static", "dynamic / static", "dynamic / auto", "poise with no settings (auto",
                 str(Path("runs/demo/compare.png"))):
        assert text in result.stdout, text
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "demo.json").read_text())
    assert data["diagnosis"]["rule"] == "straggler" and data["diagnosis"]["rank"] == 1, data["diagnosis"]
    assert [r["name"] for r in data["runs"] if r["comparison"] == "slow-rank"] == ["static", "auto", "dynamic"]
    ratios = [(r["comparison"], r["run"]) for r in data["ratios"]]
    slow_rank = [("slow-rank", "auto / static"), ("slow-rank", "dynamic / static"), ("slow-rank", "dynamic / auto")]
    if cluster_support() is None:
        assert ratios == [*slow_rank, ("slow-link", "compressed / ddp")], ratios
    else:
        assert ratios == slow_rank and "slow-network comparison skipped: " in result.stdout, ratios
    assert data["credit"].startswith("where the slow-rank gain in tokens/s comes from"), data["credit"]
    for row in data["runs"]:
        run_dir = workspace / row["dir"]  # as given to --out: relative to where the demo ran
        assert (run_dir / "report.json").is_file() and (run_dir / "trace.json").is_file(), run_dir


def _gpu_example_runs_where_it_is(result: subprocess.CompletedProcess[str], workspace: Path) -> None:
    """``examples/poise_gpu.py`` (docs/gpu.md) picked the device and backend this machine has, trained
    and wrote its report there."""
    import json

    import torch

    where = "cuda:0 (nccl)" if torch.cuda.is_available() else "cpu (gloo)"
    assert re.search(rf"^step 1 loss \d+\.\d+ on {re.escape(where)}$", result.stdout, re.M), result.stdout
    report = json.loads((workspace / "runs" / "gpu-example" / "report.json").read_text())
    assert report["backend"] == where.split("(")[1].rstrip(")") and report["world_size"] == 2, report["backend"]


# pattern -> check of the result and the page's workspace, after the command exited 0
EXPECT: dict[str, Callable[[subprocess.CompletedProcess[str], Path], None]] = {
    r"^make demo$": _demo_shows_the_comparison,
    r"examples/poise_gpu\.py --steps \d+ --out runs/gpu-example$": _gpu_example_runs_where_it_is,
}


# -- how a command is run here --------------------------------------------------------------


def _scale(match: re.Match[str]) -> str:
    """A tenth of a step count (at least 2), so counts keep their order: a resumed run's steps
    stay above its first run's, a fault step below the run's steps."""
    return f"{match.group(1)}{max(2, math.ceil(int(match.group(2)) / 10))}"


def _scale_every(match: re.Match[str]) -> str:
    return f"{match.group(1)}{max(1, math.ceil(int(match.group(2)) / 10))}"


def _cap_seq_len(match: re.Match[str]) -> str:
    return f"--max-seq-len {min(64, int(match.group(1)))}"


def _makefile_recipe(match: re.Match[str]) -> str:
    recipe = makefile_recipe(match.group(1))
    return recipe.replace("$(BIN)/", "")


@cache
def makefile_recipe(target: str) -> str:
    """The recipe of ``target`` in the Makefile (its single command line)."""
    text = (ROOT / "Makefile").read_text()
    found = re.search(rf"^{re.escape(target)}:.*\n\t(.+)$", text, re.M)
    assert found, f"the Makefile has no target {target!r}"
    return found.group(1)


TRAINING = r"poise (?:train|pipeline)\b"
# (pattern, replacement, why), applied in this order to every command that is run
REWRITES: list[tuple[str, str | Callable[[re.Match[str]], str], str]] = [
    (r"^make (\w+)$", _makefile_recipe, "make TARGET runs its recipe; the venv it depends on runs this test"),
    (r"^sudo ", "", "this test runs as root where it runs commands that need root"),
    (r"\S*\.venv/bin/poise\b", "poise", "the interpreter running the tests is first on PATH"),
    (r"(--steps )(\d+)", _scale, "a tenth of the steps (at least 2): the same code paths, sooner"),
    (r"(--checkpoint-every )(\d+)", _scale_every, "scaled with the steps"),
    (r"(--train\.eval_every )(\d+)", _scale_every, "scaled with the steps"),
    (r"(--fail-at \d+:)(\d+)", _scale, "scaled with the steps"),
    (r"--max-seq-len (\d+)", _cap_seq_len, "code-lm samples of at most 64 bytes"),
    (r"--max-bytes \S+", "--max-bytes 1M", "bus bandwidth up to 1 MB, not 64 MB-1 GB"),
    (r"--metrics\.port \d+", "--metrics.port 0", "a free port: the docs' one may be taken here"),
    (r"(?<=[\s=])/shared/", "shared/", "a shared filesystem's path, inside the workspace"),
    (r"^((?:sudo \S*)?poise cluster (?:up|down|check|run))\b", rf"\1 --name {CLUSTER_NAME}",
     "a cluster of this test's own: the default name may be another job's"),
    (r"^((?:sudo \S*)?poise cluster check\b)(?!.*--megabytes)", r"\1 --megabytes 4",
     "a 4 MB payload per transfer, not 64 MB: the same measurement, in seconds"),
]
# what every code-lm job of a command gets unless the command sets it (--task digits: not code-lm)
SMALL_CODE_LM = ("--max-seq-len", "64", "--task.eval_max_samples", "16")
# what every training command gets: timeline.png is drawn and checked by tests/e2e/test_train_cli.py (1 s a job)
NO_PLOT = ("--diagnostics.plot", "false")
DEFAULT_STEPS = "10"  # a tenth of poise train's default of 100


def rewrite(text: str) -> str:
    """``text`` as this test runs it: :data:`REWRITES`, then, for a code-lm training command,
    :data:`SMALL_CODE_LM` and (without --steps/--epochs) :data:`DEFAULT_STEPS` appended."""
    first, *body = text.split("\n")
    command = without_comment(first)
    for pattern, replacement, _ in REWRITES:
        command = re.sub(pattern, replacement, command)
    if re.search(TRAINING, command):
        extra: list[str] = []
        if "--task digits" not in command:
            for flag, value in zip(SMALL_CODE_LM[::2], SMALL_CODE_LM[1::2], strict=True):
                if flag not in command:
                    extra += [flag, value]
        if not re.search(r"--(steps|epochs) ", command):  # (a --config file's steps too: flags override it)
            extra += ["--steps", DEFAULT_STEPS]
        extra += NO_PLOT
        command = " ".join([command, *extra])
    if re.search(r"^poise demo\b", command):
        command += " --steps 12 --network-steps 4 -- " + " ".join(SMALL_CODE_LM)
    if re.search(r"-m poise\.diagnostics\.busbw|^poise diagnose busbw", command) and "--max-bytes" not in command:
        command += " --max-bytes 16M"  # (past 1M, bandwidth and not gloo's latency sets the times)
    return "\n".join([command, *body])


@dataclass(frozen=True)
class Plan:
    """What this test does with a command: ``mode`` run, variant or checked; ``run_text`` the text
    run (or parsed); ``reason`` why it is not run as written."""

    command: Command
    mode: str
    run_text: str
    reason: str = ""


@cache
def cluster_support() -> str | None:
    """Why an emulated cluster cannot be built here (one line), or None when it can."""
    from poise.cluster import net

    try:
        net.require_support()
    except net.NetError as exc:
        return str(exc)
    return None


def plan(command: Command) -> Plan:
    """Run, variant or checked (see the module docstring), with the reason."""
    text = without_comment(command.text.split("\n")[0])
    for pattern, reason in CHECKED:
        if re.search(pattern, text):
            return Plan(command, "checked", text, reason)
    for pattern, smaller, reason in VARIANTS:
        if re.search(pattern, text):
            return Plan(command, "variant", rewrite(smaller), reason)
    if any(re.search(p, text) for p in NEEDS_CLUSTER) and cluster_support() is not None:
        return Plan(command, "checked", text, f"needs an emulated cluster: {cluster_support()}")
    return Plan(command, "run", rewrite(command.text))


@cache
def all_commands() -> tuple[Command, ...]:
    return tuple(c for page in PAGES for c in extract_commands(page))


@cache
def _first_places() -> dict[str, Command]:
    seen: dict[str, Command] = {}
    for c in all_commands():
        seen.setdefault(c.bare, c)
    return seen


def first_place(text: str) -> Command:
    """Where a command text first appears: it is run there (the README's tour repeats some of the pages')."""
    return _first_places()[text]


def _unique() -> list[Command]:
    """Each command text once, at its first place."""
    return list(_first_places().values())


# -- workspaces: one per page, commands in page order, two pages at a time -------------------

# A command is mostly start-up (three Python processes importing torch), about one core's worth:
# two pages at a time keep both cores of a 2-core machine busy. Within a page, strictly in order.
PARALLEL_PAGES = 2


class EarlierCommandFailed(AssertionError):
    """A command of the page before this one failed, so this one was not run."""


class Runner:
    """Runs each page's commands in order in the page's own workspace, each once, in the background
    (:data:`PARALLEL_PAGES` pages at a time); a test waits for its command's result."""

    def __init__(self, root: Path, cache_home: Path) -> None:
        self.root = root
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(cache_home),
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        self._lock = threading.Lock()
        self._results: dict[tuple[str, str], Future[subprocess.CompletedProcess[str]]] = {}
        self._pages: dict[str, Future[None]] = {}
        self._pool = ThreadPoolExecutor(max_workers=PARALLEL_PAGES, thread_name_prefix="docs-page")

    def workspace(self, page: str) -> Path:
        return self.root / page.replace("/", "_").removesuffix(".md")

    def start(self, wanted: list[Command]) -> None:
        """Run, in the background, every page's commands up to the last of ``wanted`` on it (a page
        another page reads from, whole), the pages that others read first."""
        last: dict[str, Command | None] = {}
        for c in wanted:
            last[c.page] = c
            for _, other in FROM_OTHER_PAGES.get(c.page, []):
                last[other] = None
        with self._lock:
            for page in sorted(last, key=lambda pg: (pg in FROM_OTHER_PAGES, pg)):  # README.md sorts first
                if page in self._pages:
                    continue
                steps = []
                for c in _page_commands(page):
                    key = (page, c.bare)
                    self._results[key] = Future()
                    steps.append((c, self._results[key]))
                    if c == last[page]:
                        break
                self._pages[page] = self._pool.submit(self._run_page, page, steps)

    def result(self, command: Command, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """``command``'s result, once its page got there (started now if it was not)."""
        if (command.page, command.bare) not in self._results:
            self.start([command])
        return self._results[(command.page, command.bare)].result(timeout=timeout_s)

    def _run_page(self, page: str, steps: list[tuple[Command, Future[subprocess.CompletedProcess[str]]]]) -> None:
        failed = ""
        try:
            path = self.workspace(page)
            path.mkdir(parents=True)
            (path / "examples").symlink_to(ROOT / "examples")  # the pages' commands run from the repository root
            for rel, other in FROM_OTHER_PAGES.get(page, []):
                self._pages[other].result()  # started before this page (see start)
                source = self.workspace(other) / rel
                if not source.exists():
                    raise EarlierCommandFailed(f"{other} was to make {rel} for {page}: its commands failed")
                shutil.copytree(source, path / rel, symlinks=True)
            for c, future in steps:
                if failed:
                    future.set_exception(EarlierCommandFailed(failed))
                    continue
                done = run_text(plan(c).run_text, path, self.env)
                future.set_result(done)
                if done.returncode != 0:
                    failed = (f"an earlier command of {page} failed ({c.where}: {c.bare.splitlines()[0]}), exit "
                              f"{done.returncode}:\n{_tail(done)}")
        except BaseException as exc:  # every waiting test gets it: none hangs
            for _, future in steps:
                if not future.done():
                    future.set_exception(exc)

    def close(self) -> None:
        """Stop starting commands, wait for the running ones, and take this test's cluster down in
        case a page brought it up and stopped before its ``down`` (a failed command)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if cluster_support() is None:
            subprocess.run(["bash", "-c", f"poise cluster down --name {CLUSTER_NAME}"], env=self.env,
                           capture_output=True, timeout=120)


# what makes a command more than one plain ``poise`` invocation: pipes, redirections, variables, globs, lists
SHELL_SYNTAX = re.compile(r"[|&;<>$`*?()\\\n]")


def run_text(text: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run one command of a page: a plain ``poise ...`` or ``torchrun ...`` in a process forked
    from the tests' warm server (:func:`tests.harness.run_cli`: the same command, without its
    interpreter's start), any other through bash."""
    program = text.split(" ", 1)[0]
    if program in ("poise", "torchrun") and not SHELL_SYNTAX.search(text):
        return run_cli(shlex.split(text)[1:], cwd=cwd, env=env, timeout_s=COMMAND_TIMEOUT_S, program=program)
    return subprocess.run(["bash", "-c", text], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)


def _page_commands(page: str) -> list[Command]:
    """The commands run on ``page``, in order: not the checked ones, and a command repeated from an
    earlier page (the README's tour) only at its first place."""
    return [c for c in all_commands() if c.page == page and first_place(c.bare) == c and plan(c).mode != "checked"]


def _tail(result: subprocess.CompletedProcess[str]) -> str:
    return (result.stdout[-1500:] + "\n" + result.stderr[-3000:]).strip()


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           cache_dir: Path) -> Iterator[Runner]:
    cache_home = tmp_path_factory.mktemp("docs-cache")
    (cache_home / "poise").symlink_to(cache_dir)  # the session's corpus index (code_lm's $XDG_CACHE_HOME/poise)
    runner = Runner(Path(tempfile.mkdtemp(prefix="poise-docs-", dir=tmp_path_factory.getbasetemp())), cache_home)
    # every selected command's page starts now, so that pages run side by side while tests wait in order
    selected = [item.callspec.params["command"] for item in request.session.items
                if getattr(item, "callspec", None) and isinstance(item.callspec.params.get("command"), Command)]
    runner.start([c for c in selected if plan(c).mode != "checked"])
    yield runner
    runner.close()


# -- the tests ----------------------------------------------------------------------------------


def check_arguments(text: str) -> None:
    """Parse ``text`` with poise's own parser and resolve a training command's config: a renamed
    flag or setting fails here although the command is not run."""
    from poise import cli
    from poise.cli.flags import resolve

    words = shlex.split(re.sub(r"^sudo ", "", text))
    if words[0] == "make":  # a target of the Makefile
        assert re.search(rf"^{re.escape(words[1])}:", (ROOT / "Makefile").read_text(), re.M), text
        return
    if words[0] in ("python", "pip", ".", "srun", "torchrun"):
        check_other_tool(words, text)
        return
    assert re.fullmatch(r"(\S*/)?poise", words[0]), f"only poise commands can be checked without running: {text}"
    parser = cli.build_parser()
    try:
        args = parser.parse_args(words[1:])
    except SystemExit as exc:
        raise AssertionError(f"poise rejects the arguments of {text!r} (exit {exc.code})") from None
    if args.command in ("train", "pipeline"):
        resolve(args)
    forwarded = getattr(args, "train_args", None)
    if args.command == "bench" and forwarded:
        resolve(parser.parse_args(["train", *forwarded]))


def check_other_tool(words: list[str], text: str) -> None:
    """A command of another tool, checked without running it: pip's extras exist in pyproject.toml,
    the activated environment is the Makefile's, and torchrun's arguments (under ``srun``, after
    its options) parse with torch's own parser and name a script of this repository."""
    import tomllib

    if words[0] == ".":
        venv = re.search(r"^VENV := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
        assert venv and words[1:] == [f"{venv[1]}/bin/activate"], text
        return
    if words[0] in ("python", "pip"):
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for word in words:
            for named in re.findall(r"\[([\w,-]+)\]$", word):
                unknown = set(named.split(",")) - set(extras)
                assert not unknown, f"{text}: no such extra in pyproject.toml: {sorted(unknown)}"
        return
    if words[0] == "srun":
        words = words[words.index("torchrun"):]
    from torch.distributed.run import get_args_parser

    try:
        args = get_args_parser().parse_args(words[1:])
    except SystemExit as exc:
        raise AssertionError(f"torchrun rejects the arguments of {text!r} (exit {exc.code})") from None
    assert (ROOT / args.training_script).is_file(), f"{text}: no script {args.training_script}"


def _id(c: Command) -> str:
    text = without_comment(c.text.split("\n")[0])
    return f"{c.where} {text[:70]}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("command", _unique(), ids=_id)
def test_command(command: Command, runner: Runner) -> None:
    p = plan(command)
    if p.mode == "checked":
        check_arguments(p.run_text)
        return
    result = runner.result(command, timeout_s=COMMAND_WAIT_S)
    places = [c.where for c in all_commands() if c.bare == command.bare]
    assert result.returncode == 0, (f"{' and '.join(places)}: {command.text.splitlines()[0]}\nran: {p.run_text}\n"
                                    f"exit {result.returncode}\n{_tail(result)}")
    for pattern, check in EXPECT.items():
        if re.search(pattern, without_comment(command.text)):
            check(result, runner.workspace(command.page))


@pytest.mark.timeout(60)
def test_every_table_entry_matches_a_command() -> None:
    texts = [without_comment(c.text.split("\n")[0]) for c in all_commands()]
    patterns = [p for p, _ in CHECKED] + [p for p, _, _ in VARIANTS] + NEEDS_CLUSTER + list(EXPECT)
    unused = [p for p in patterns if not any(re.search(p, t) for t in texts)]
    assert not unused, f"entries that match no command of the pages (remove them): {unused}"
    assert all(reason.strip() for _, reason in CHECKED) and all(r.strip() for _, _, r in VARIANTS)
    pattern_rewrites = [p for p, _, _ in REWRITES]
    unused = [p for p in pattern_rewrites if not any(re.search(p, t) for t in texts)]
    assert not unused, f"rewrites that change no command (remove them): {unused}"
    for page, needs in FROM_OTHER_PAGES.items():
        assert (ROOT / page).is_file() and all((ROOT / other).is_file() for _, other in needs), page
    # every command is run, run as a variant or checked with a reason: nothing else
    for c in all_commands():
        p = plan(c)
        assert p.mode in ("run", "variant", "checked") and (p.mode == "run" or p.reason), c.where


@pytest.mark.timeout(60)
def test_every_page_has_commands_and_the_readme_starts_with_the_two() -> None:
    found = {c.page for c in all_commands()}
    for page in PAGES:
        rel = str(page.relative_to(ROOT))
        # a design note, a source map, a glossary
        if rel not in ("docs/elastic-scheduling.md", "docs/layout.md", "docs/concepts.md"):
            assert rel in found, f"{rel} has no ```bash command"
    readme = [without_comment(c.text) for c in all_commands() if c.page == "README.md"]
    assert readme[:2] == ["make demo", "make test"], readme[:2]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.timeout(60)
def test_links_between_pages_resolve() -> None:
    broken = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                headings = [_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)]
                if anchor not in headings:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


@pytest.mark.timeout(60)
def test_without_a_cluster_its_commands_are_checked_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "cluster_support", lambda: "poise cluster needs root")
    cluster = [c for c in all_commands() if re.search(r"^(sudo \S*poise|poise) cluster (up|check)|--cluster \d",
                                                         c.bare)]
    assert cluster
    for c in cluster:
        p = plan(c)
        assert p.mode == "checked" and p.reason == "needs an emulated cluster: poise cluster needs root", c.where
        check_arguments(p.run_text)
    # the demo runs anyway: it skips its network pair itself, saying why
    assert plan(next(c for c in all_commands() if c.bare == "make demo")).mode == "run"


@pytest.mark.timeout(60)
def test_rewrites_keep_step_counts_in_order() -> None:
    # the checkpoint page resumes a run with more steps than it had: still more after the rewrite
    first = rewrite("poise train --checkpoint-every 50 --out runs/a --steps 200")
    resumed = rewrite("poise train --checkpoint-every 50 --resume --out runs/a --steps 400")
    assert "--steps 20 " in first + " " and "--steps 40" in resumed and "--checkpoint-every 5" in first
    assert rewrite("poise train --task digits --fail-at 1:30 --steps 60").startswith(
        "poise train --task digits --fail-at 1:3 --steps 6")
    assert rewrite("poise train --balance static").endswith(
        "--max-seq-len 64 --task.eval_max_samples 16 --steps 10 --diagnostics.plot false")
    assert rewrite("make demo").startswith("poise demo --out runs/demo --steps 12")
    assert without_comment("poise bench codecs --kernels '' --steps 3   # a '#' in a comment") == (
        "poise bench codecs --kernels '' --steps 3")
