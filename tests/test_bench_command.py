"""``microbatch bench``: arguments, finding the checkout, running suites, RESULTS.md sections; and
the peers benchmark's correctness numbers on its tiny cases."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from microbatch import cli
from microbatch.commands import bench
from microbatch.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"

# A suite that reports the arguments it was given, so the test can see --quick and --json arrive.
FAKE_SUITE = textwrap.dedent(
    """
    import json, sys
    print("progress lines before the JSON are allowed")
    print(json.dumps({
        "title": "Fake suite",
        "argv": sys.argv[1:],
        "markdown": "| a | b |\\n|---|---|\\n| 1 | 2 |\\n",
        "plots": [{"name": "fake", "kind": "bar", "title": "Fake", "ylabel": "y", "log": True,
                   "labels": ["x1", "x2"], "series": {"one": [1e-3, None], "two": [0.5, 2.0]}}],
    }))
    """
)


def load_script(name: str) -> ModuleType:
    """A benchmarks/ script or package as a module (benchmarks/ on sys.path, as the suites have it)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    if (BENCHMARKS / name / "__init__.py").is_file():
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A minimal source checkout: benchmarks/results.py and one fake suite."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(BENCHMARKS / "results.py", tmp_path / "benchmarks" / "results.py")
    (tmp_path / "benchmarks" / "fake.py").write_text(FAKE_SUITE)
    return tmp_path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# Arguments and the checkout


def test_arguments_default_to_every_suite_full_size() -> None:
    args = parse([])
    assert (args.suites, args.quick, args.json, args.root, args.output) == ([], False, False, None, None)
    args = parse(["peers", "accumulate-overhead", "--quick", "--json", "--timeout", "30"])
    assert args.suites == ["peers", "accumulate-overhead"] and args.quick and args.json
    assert args.timeout == 30.0


def test_missing_benchmarks_folder_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=r"benchmarks/ of a source checkout.*installed wheel.*--root"):
        bench.find_root(tmp_path)
    assert cli.main(["bench", "--root", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("microbatch bench: error:") and "pip install -e '.[bench]'" in error
    assert "\n" not in error  # one line, no traceback


def test_installed_wheel_uses_the_working_directory_or_refuses(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory, checkout: Path
) -> None:
    # As from site-packages: the package sits in no checkout.
    wheel = tmp_path_factory.mktemp("venv") / "site-packages"
    monkeypatch.setattr(bench, "__file__", str(wheel / "microbatch" / "commands" / "bench.py"))
    with pytest.raises(ConfigError, match="installed wheel"):
        bench.find_root(cwd=wheel)
    assert bench.find_root(cwd=checkout / "benchmarks") == checkout.resolve()  # run from a checkout


def test_root_is_the_editable_checkout_or_the_one_named(checkout: Path) -> None:
    assert bench.find_root() == REPO
    assert bench.find_root(cwd=checkout) == REPO  # the package's own checkout comes first
    assert bench.find_root(checkout) == checkout.resolve()


def test_suites_resolve_in_order_and_unknown_names_fail(checkout: Path) -> None:
    (checkout / "benchmarks" / "peers.py").write_text("")
    (checkout / "benchmarks" / "zeta.py").write_text("")
    (checkout / "benchmarks" / "_helper.py").write_text("")
    assert bench.resolve_suites(checkout, []) == ["peers", "fake", "zeta"]  # results.py is not a suite
    assert bench.resolve_suites(checkout, ["zeta", "fake.py", "zeta"]) == ["zeta", "fake"]
    with pytest.raises(ConfigError, match=r"unknown suite 'nope'.*peers, fake, zeta"):
        bench.resolve_suites(checkout, ["nope"])
    assert bench.resolve_suites(REPO, ["peers"]) == ["peers"]


def test_bad_timeout_is_refused(checkout: Path) -> None:
    with pytest.raises(ConfigError, match="--timeout"):
        bench.run(parse(["--root", str(checkout), "--timeout", "0"]))


# ------------------------------------------------------------------------------------------------
# Running suites and writing RESULTS.md


def test_runs_a_suite_passes_flags_and_writes_its_section_and_plot(
    checkout: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results_md = checkout / "benchmarks" / "RESULTS.md"
    results_md.write_text(
        "# Benchmark results\n\n## Other\n\nkept as it was\n\n## Fake suite\n\nold numbers\n"
    )
    assert cli.main(["bench", "fake", "--root", str(checkout), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["suites"]["fake"]["argv"] == ["--json"]
    text = results_md.read_text()
    assert "kept as it was" in text and "old numbers" not in text
    assert text.count("## Fake suite") == 1 and "| 1 | 2 |" in text
    assert (
        "![Fake](plots/fake.png)" in text
        and (checkout / "benchmarks" / "plots" / "fake.png").stat().st_size > 0
    )


def test_quick_goes_through_and_writes_the_quick_file(
    checkout: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "--root", str(checkout), "--quick", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["suites"]["fake"]["argv"] == ["--json", "--quick"]
    assert not (checkout / "benchmarks" / "RESULTS.md").exists()  # full results are never overwritten
    assert "## Fake suite" in (checkout / "benchmarks" / "RESULTS-quick.md").read_text()
    assert (checkout / "benchmarks" / "plots" / "fake-quick.png").exists()


def test_a_failing_suite_is_reported_and_leaves_results_alone(
    checkout: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (checkout / "benchmarks" / "broken.py").write_text("raise SystemExit('broken on purpose')\n")
    (checkout / "benchmarks" / "silent.py").write_text("print('not json')\n")
    assert cli.main(["bench", "broken", "silent", "--root", str(checkout)]) == 1
    captured = capsys.readouterr()
    assert "broken on purpose" in captured.err and "no JSON object" in captured.out
    assert not (checkout / "benchmarks" / "RESULTS.md").exists()


def test_write_section_replaces_one_section_and_ignores_headings_in_code(tmp_path: Path) -> None:
    results = load_script("results")
    path = tmp_path / "RESULTS.md"
    results.write_section("A", "first\n\n```\n## not a heading\n```", path=path)
    results.write_section("B", "second", path=path)
    results.write_section("A", "first again", path=path)
    text = path.read_text()
    assert text.startswith("# Benchmark results")
    assert text.index("## A") < text.index("first again") < text.index("## B") < text.index("second")
    assert "## not a heading" not in text and text.count("## A") == 1
    line = results.environment_line()
    assert "CPUs, torch " in line and line.rstrip()[-10:-6].isdigit()  # ends with the date
    with pytest.raises(ValueError, match="title"):
        results.write_section("two\nlines", "x", path=path)


# ------------------------------------------------------------------------------------------------
# The peers benchmark's correctness part, on its tiny cases (float64 reference in the script)


@pytest.mark.slow  # first float64 calls warm torch up: several seconds on a shared machine
def test_peers_microbatch_is_exact_and_dividing_by_steps_is_not() -> None:
    peers = load_script("peers")
    errors = peers.run_correctness(("microbatch", "nanogpt"))
    for case in peers.CASES:
        assert errors["microbatch"][case] <= 1e-6, (case, errors["microbatch"][case])
    # Dividing by the step count: exact where every micro-batch holds as many items, wrong otherwise.
    assert errors["nanogpt"]["equal"] <= 1e-6 and errors["nanogpt"]["clip"] <= 1e-6
    assert errors["nanogpt"]["varlen"] > 1e-2
    assert errors["nanogpt"]["partial"] is None  # nanoGPT never has a partial last window


@pytest.mark.slow  # imports accelerate
def test_peers_accelerate_is_wrong_on_variable_lengths_and_the_partial_window() -> None:
    pytest.importorskip("accelerate")
    peers = load_script("peers")
    errors = peers.run_correctness(("microbatch", "accelerate"))
    assert max(errors["microbatch"].values()) <= 1e-6
    assert errors["accelerate"]["varlen"] > 1e-2
    # A short last window of 3 micro-batches divided by 4: the gradient is 3/4 of the full batch's.
    assert errors["accelerate"]["partial"] == pytest.approx(0.25, rel=1e-6)
    assert errors["accelerate"]["equal"] <= 1e-6 and errors["accelerate"]["clip"] <= 1e-6
