"""Mutation testing, one package at a time: `make mutation` (all scopes) or `make mutation SCOPES="spool"`.

Each scope mutates one package and runs only the tests that mirror it (mutmut runs, for each mutant, those
of them that reach the mutated function). It runs in a copy of the tree under .cache/mutation/<scope>/,
whose pyproject.toml is the repository's with the scope's only_mutate and test selection added to
[tool.mutmut], so scopes never share mutmut's state. Results: .cache/mutation/<scope>/summary.json (counts
and score) and survivors.txt (each surviving mutant's diff); mutants that timed out are run once more, alone, first.
docs/mutation.md records the results.

    python scripts/mutation.py [--mutmut PYTHON] [--jobs N] [SCOPE ...]   # SCOPE may be collectors:xid,gpm
                                                                          # or server:http,auth

PYTHON is the interpreter that has mutmut (the Makefile's .cache/mutation-venv); the project's own venv
provides everything else through a .pth file there, so mutmut never goes into the project's venv.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "mutation"

# the collectors' tests; the ranks collector's are test_ranks_collector.py and test_rank_view.py (test_contract.py's
# golden exposition reaches it too, but its exporter's start timed out in mutmut's stats run on a loaded machine)
COLLECTOR_TESTS = [
    "tests/server/test_collector_framework.py",
    "tests/server/test_collector_runner.py",
    "tests/server/test_nvml_collector.py",
    "tests/server/test_xid.py",
    "tests/server/test_gpm_collector.py",
    "tests/server/test_collector_faults.py",
    "tests/server/test_rank_view.py",
    "tests/server/test_ranks_collector.py",
]

# the server's core (vramwatch/server/*.py, not collectors/): every fast test of tests/server (a mutant runs only
# those that reach its function). Deselected: tests of a second or more each (floods, overload, slowloris, a
# hung watch), which `make test` runs; the collectors' runner tests reach no core module. The import probes run
# a fresh interpreter (mutmut sees no function reached) whose imports in mutmut's copy are its trampolines'.
SERVER_TESTS = [
    "tests/server",
    "tests/spool/test_schema.py",  # ExporterCollector (registry.py) on every schema version
    *(
        f"--deselect=tests/server/{t}"
        for t in (
            "test_http_admission.py::test_a_password_flood_never_takes_the_slots_an_authenticated_scraper_needs",
            "test_http_admission.py::test_under_sustained_overload_prometheus_scrapes_are_served",
            "test_http_robustness.py::test_slowloris_takes_no_slot_and_is_cut_off_at_the_deadline",
            "test_http_robustness.py::test_connection_flood_keeps_threads_bounded",
            "test_bad_samples.py::test_any_one_field_mutated_drops_at_most_that_rank",
            "test_collector_runner.py::test_stop_does_not_close_while_a_read_may_still_run",
            "test_collector_runner.py::test_stop_waits_for_a_hung_watch_only_a_bounded_time",
            "test_http_transport.py::test_out_of_descriptors_accept_waits_instead_of_spinning",
            "test_server_imports.py::test_the_server_imports_nothing_heavy",
        )
    ),
]
SERVER_MODULES = sorted(f"vramwatch/server/{p.name}" for p in (ROOT / "vramwatch" / "server").glob("*.py"))

# scope -> (what to mutate, the tests that mirror it). Slow end-to-end tests stay out (pyproject's
# pytest_add_cli_args deselects `slow`); each mutant runs only the selected tests that reach its function.
SCOPES: dict[str, tuple[list[str], list[str]]] = {
    "spool": (["vramwatch/spool/*"], ["tests/spool"]),
    "contract": (["vramwatch/monitoring/contract.py"], ["tests/monitoring/test_contract.py"]),
    # promtool's rule tests (tests/monitoring/test_promtool.py) take ~15 s a mutant: `make test` runs them.
    # The literal scan reads the rule modules' source, which in mutmut's copy holds every mutant's code.
    "alerts": (
        ["vramwatch/monitoring/alerts/*"],
        [
            "tests/monitoring/test_alerts.py",
            "tests/monitoring/test_alert_paths.py",
            "--deselect=tests/monitoring/test_alerts.py::test_no_threshold_literals_outside_monitoring_config",
        ],
    ),
    "rank": (["vramwatch/rank/*"], ["tests/rank"]),
    "collectors": (["vramwatch/server/collectors/*"], COLLECTOR_TESTS),
    "server": (SERVER_MODULES, SERVER_TESTS),
    # the callbacks' hooks driven directly (milliseconds); test_hf.py / test_lightning.py train real models,
    # seconds per mutant on two cores, and run in `make test`
    "integrations": (["vramwatch/integrations/*"], ["tests/integrations/test_callbacks.py"]),
    # one module of collectors, for a quick rerun after its tests change
    "processes": (["vramwatch/server/collectors/processes.py"], COLLECTOR_TESTS),
    # the heartbeat and its device-scalar reader, part of rank, with their fast tests only
    "rank-heartbeat": (
        ["vramwatch/rank/heartbeat.py", "vramwatch/rank/device_scalar.py"],
        ["tests/rank/test_heartbeat.py", "tests/rank/test_device_scalar.py"],
    ),
    "rank-status": (["vramwatch/rank/status.py"], ["tests/rank/test_status.py", "tests/rank/test_status_paths.py"]),
    "rank-oom": (["vramwatch/rank/oom.py"], ["tests/rank/test_oom.py", "tests/rank/test_oom_paths.py"]),
    # the rest of rank (handle, sampler, allocator, roles, ...) with all of rank's tests
    "rank-rest": (
        sorted(
            f"vramwatch/rank/{p.name}"
            for p in (ROOT / "vramwatch" / "rank").glob("*.py")
            if p.name not in {"oom.py", "heartbeat.py", "device_scalar.py", "status.py"}
        ),
        ["tests/rank"],
    ),
}
PARTS = (
    "processes",
    "rank-heartbeat",
    "rank-status",
    "rank-oom",
    "rank-rest",
)  # parts of a larger scope: run only when named
# "collectors:xid,gpm" / "server:http,auth": only those modules of the scope's directory, with the scope's tests
PART_OF: dict[str, tuple[str, list[str]]] = {
    "collectors:": ("vramwatch/server/collectors", COLLECTOR_TESTS),
    "server:": ("vramwatch/server", SERVER_TESTS),
}


# never copied when the tree is walked without git: caches, virtualenvs, wheels, mutmut's own copies
WALK_SKIP = {".git", ".cache", ".venv", "mutants", "__pycache__"}


def tree_files() -> list[str]:
    """The repository's files as git sees them (tracked, and untracked but not ignored); without git (the GPU
    machine gets the tree without .git) a walk of the tree that skips WALK_SKIP and what .gitignore ignores."""
    if (ROOT / ".git").exists():
        try:
            out = subprocess.run(
                ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                cwd=ROOT,
                capture_output=True,
                check=True,
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            pass  # no git binary, or a .git it cannot read: walk instead
        else:
            return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]
    return walk_files(ROOT)


def _ignore_rules(directory: Path, rel: str) -> list[tuple[str, str, bool, bool]]:
    """(base, pattern, anchored, directories only) for each simple line of directory/.gitignore; `!` lines
    (re-includes) are not supported and are left out, so a re-included file is not copied."""
    try:
        lines = (directory / ".gitignore").read_text().splitlines()
    except OSError:
        return []
    rules = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line  # git: a slash anywhere but at the end anchors the pattern to its .gitignore
        if line:
            rules.append((rel, line.lstrip("/"), anchored, dir_only))
    return rules


def _ignored(rel: str, is_dir: bool, rules: list[tuple[str, str, bool, bool]]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    for base, pattern, anchored, dir_only in rules:
        if (dir_only and not is_dir) or (base and not rel.startswith(base + "/")):
            continue
        below = rel[len(base) + 1 :] if base else rel  # the path relative to the .gitignore's directory
        if fnmatch.fnmatchcase(below if anchored else name, pattern):
            return True
    return False


def walk_files(root: Path) -> list[str]:
    """Every file under root, as paths relative to it, but WALK_SKIP, `.whl*` and what the .gitignore files
    ignore (simple patterns: globs, a leading or inner `/` anchoring, a trailing `/` for directories)."""
    files: list[str] = []
    rules_at: dict[str, list[tuple[str, str, bool, bool]]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = "" if here == root else here.relative_to(root).as_posix()
        parent = rel_dir.rpartition("/")[0]
        rules = (rules_at.get(parent, []) if rel_dir else []) + _ignore_rules(here, rel_dir)
        rules_at[rel_dir] = rules
        prefix = f"{rel_dir}/" if rel_dir else ""
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in WALK_SKIP
            and not d.startswith(".whl")
            and not (here / d).is_symlink()
            and not _ignored(prefix + d, True, rules)
        )
        files += [
            prefix + f
            for f in sorted(filenames)
            if f not in WALK_SKIP and (here / f).is_file() and not _ignored(prefix + f, False, rules)
        ]
    return files


def child_pythonpath(value: str | None, cwd: Path) -> str | None:
    """PYTHONPATH for mutmut: the caller's entries, absolute, but the repository root (the copy's code must
    win over the tree's) and empty ones (the current directory); a mutmut installed with `pip --target` is
    found through PYTHONPATH. None when nothing is left."""
    kept = []
    for entry in (value or "").split(os.pathsep):
        if not entry:
            continue
        path = Path(entry) if os.path.isabs(entry) else cwd / entry
        if path.resolve() == ROOT:
            continue
        kept.append(str(path))
    return os.pathsep.join(kept) or None


def child_env(environ: Mapping[str, str], cwd: Path) -> dict[str, str]:
    """The environment of mutmut and its test children."""
    env = {k: v for k, v in environ.items() if k != "PYTHONPATH"}  # the copy's code, never the tree's
    pythonpath = child_pythonpath(environ.get("PYTHONPATH"), cwd)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env.setdefault("TEST_TOOLS_DIR", str(ROOT / ".cache" / "debian" / "usr" / "bin"))
    # mutmut forks each mutant's run from a process that has run the tests: torch's OpenMP pool does not
    # survive a fork, and on 16 cores 102-175 mutants a run ended "segfault" until it had one thread
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, "1")
    return env


def toml_list(items: list[str]) -> str:
    return json.dumps(items)  # a JSON array of strings is a TOML array


def scope_of(name: str) -> tuple[list[str], list[str]]:
    for prefix, (directory, tests) in PART_OF.items():
        if name.startswith(prefix):
            modules = [m for m in name[len(prefix) :].split(",") if m]
            missing = [m for m in modules if not (ROOT / directory / f"{m}.py").is_file()]
            if not modules or missing:
                raise SystemExit(f"no {prefix[:-1]} module {missing[0] if missing else '(none given)'!r}")
            return [f"{directory}/{m}.py" for m in modules], tests
    return SCOPES[name]


def work_dir(scope: str) -> Path:
    return WORK / scope.replace(":", "-").replace(",", "-")


def prepare(scope: str) -> Path:
    mutate, tests = scope_of(scope)
    dest = work_dir(scope)
    if dest.exists():
        shutil.rmtree(dest)
    for f in tree_files():
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    pyproject = dest / "pyproject.toml"
    text = pyproject.read_text()
    header = "[tool.mutmut]\n"
    if header not in text:
        raise SystemExit(f"{ROOT / 'pyproject.toml'} has no {header.strip()} table")
    added = f"only_mutate = {toml_list(mutate)}\npytest_add_cli_args_test_selection = {toml_list(tests)}\n"
    pyproject.write_text(text.replace(header, header + added, 1))
    return dest


def _results(mm: list[str], dest: Path, env: dict[str, str]) -> list[tuple[str, str]]:
    """(mutant, verdict) for every mutant not killed: survived, timeout, no tests, ..."""
    listing = subprocess.run([*mm, "results"], cwd=dest, env=env, capture_output=True, text=True, check=True).stdout
    return [(n.strip(), v.strip()) for n, _, v in (line.partition(":") for line in listing.splitlines()) if v]


def run_scope(scope: str, mutmut: str, jobs: int) -> dict[str, object]:
    dest = prepare(scope)
    env = child_env(os.environ, Path.cwd())
    mm = [os.path.abspath(mutmut), "-m", "mutmut"]  # absolute: it runs in the copy
    with open(dest / "mutmut.log", "w") as log:
        r = subprocess.run([*mm, "run", "--max-children", str(jobs)], cwd=dest, env=env, stdout=log, stderr=log)
    if r.returncode != 0:
        raise SystemExit(f"mutmut run failed for {scope} ({r.returncode}): see {dest / 'mutmut.log'}")
    # a timeout on a loaded machine may be a slow kill or a slow survivor: run those mutants once more, alone
    timeouts = [n for n, verdict in _results(mm, dest, env) if verdict == "timeout"]
    if timeouts:
        with open(dest / "mutmut.log", "a") as log:
            subprocess.run([*mm, "run", "--max-children", "1", *timeouts], cwd=dest, env=env, stdout=log, stderr=log)
    subprocess.run([*mm, "export-cicd-stats"], cwd=dest, env=env, check=True, capture_output=True)
    stats = json.loads((dest / "mutants" / "mutmut-cicd-stats.json").read_text())
    tested = int(stats.get("total", 0)) - int(stats.get("skipped", 0))
    caught = int(stats.get("killed", 0)) + int(stats.get("timeout", 0)) + int(stats.get("caught_by_type_check", 0))
    summary: dict[str, object] = {"scope": scope, **stats, "score": round(100 * caught / tested, 1) if tested else None}
    summary["timeouts_rerun"] = len(timeouts)
    with open(dest / "survivors.txt", "w") as out:
        for name, verdict in _results(mm, dest, env):
            if verdict != "survived":
                out.write(f"# {name}: {verdict}\n")
                continue
            shown = subprocess.run([*mm, "show", name], cwd=dest, env=env, capture_output=True, text=True)
            out.write(shown.stdout + "\n")
    (dest / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "scopes",
        nargs="*",
        help=f"one of {', '.join(SCOPES)}, or {' or '.join(PART_OF)}MODULE,...; default: all but {', '.join(PARTS)}",
    )
    ap.add_argument("--mutmut", default=sys.executable, help="a Python that has mutmut")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = ap.parse_args(argv)
    unknown = [s for s in args.scopes if s not in SCOPES and not s.startswith(tuple(PART_OF))]
    if unknown:
        ap.error(f"unknown scope {unknown[0]!r}; one of {', '.join(SCOPES)}")
    for scope in args.scopes or [s for s in SCOPES if s not in PARTS]:
        s = run_scope(scope, args.mutmut, args.jobs)
        print(
            f"{scope}: score {s['score']}% ({s.get('killed')} killed, {s.get('survived')} survived, "
            f"{s.get('no_tests')} without tests, {s.get('timeout')} timeouts of {s.get('total')}); "
            f"{work_dir(scope) / 'survivors.txt'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
