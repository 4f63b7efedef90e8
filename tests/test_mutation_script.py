"""scripts/mutation.py without git (the GPU machine gets the tree without .git) and its child's PYTHONPATH."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():  # scripts/ is no package: load the script as a module
    spec = importlib.util.spec_from_file_location("mutation_script", ROOT / "scripts" / "mutation.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_script"] = module
    spec.loader.exec_module(module)
    return module


mutation = _load()


def _tree(root: Path, files: list[str]) -> None:
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text(f)


def test_walk_skips_caches_venvs_wheels_and_what_gitignore_ignores(tmp_path: Path) -> None:
    kept = ["pyproject.toml", "vramwatch/a.py", "tests/t.py", "docs/build/keep.md", "sub/x.txt", "sub/.gitignore"]
    dropped = [
        ".git/config",
        ".git/objects/ab",
        ".cache/mutation/x.py",
        ".whl/w.whl",
        ".whl-cache/w.whl",
        "mutants/vramwatch/a.py",
        "vramwatch/__pycache__/a.cpython-311.pyc",
        "vramwatch/b.pyc",  # *.pyc
        "build/lib/a.py",  # /build/ is anchored: only the top one
        "x.egg-info/PKG-INFO",  # *.egg-info/
        "out/report.html",  # /out/
        "sub/gen.log",  # sub/.gitignore's *.log
        "sub/deep/gen.log",
    ]
    # the virtualenv among them (test_layout keeps the name out of the tests' literals)
    dropped += [f"{d}/bin/python" for d in sorted(mutation.WALK_SKIP)]
    _tree(tmp_path, kept + dropped + [".gitignore"])
    (tmp_path / ".gitignore").write_text(
        "# comment\n\n*.pyc\n/build/\n*.egg-info/\n/out/\n!vramwatch/b.pyc\n", encoding="utf-8"
    )
    (tmp_path / "sub" / ".gitignore").write_text("*.log\n", encoding="utf-8")
    (tmp_path / "egg.egg-info").write_text("a file, and the pattern names directories only")
    got = mutation.walk_files(tmp_path)
    assert {".git", ".cache", "mutants", "__pycache__"} < mutation.WALK_SKIP and len(mutation.WALK_SKIP) == 5
    assert set(got) == {*kept, ".gitignore", "egg.egg-info"}


def test_walk_skips_a_worktrees_git_file_and_symlinked_directories(tmp_path: Path) -> None:
    _tree(tmp_path, ["a.py", "elsewhere/b.py"])
    (tmp_path / ".git").write_text("gitdir: /somewhere/else\n")  # a worktree's .git is a file
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert set(mutation.walk_files(tmp_path)) == {"a.py", "elsewhere/b.py"}


def test_tree_files_walks_a_tree_without_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path, ["pyproject.toml", "vramwatch/a.py", ".cache/x"])
    monkeypatch.setattr(mutation, "ROOT", tmp_path)
    assert sorted(mutation.tree_files()) == ["pyproject.toml", "vramwatch/a.py"]


def test_tree_files_walks_when_git_cannot_be_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path, ["a.py", ".git/HEAD"])
    monkeypatch.setattr(mutation, "ROOT", tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no git binary
    assert mutation.tree_files() == ["a.py"]


def test_tree_files_matches_git_in_this_checkout() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("a tree without .git")
    assert set(mutation.walk_files(ROOT)) == set(mutation.tree_files())


def test_child_pythonpath_keeps_all_but_the_repository_root(tmp_path: Path) -> None:
    root = str(mutation.ROOT)
    value = os.pathsep.join([root, "/opt/mutmut-target", "", "rel/dir", root + "/"])
    assert mutation.child_pythonpath(value, tmp_path) == os.pathsep.join(
        ["/opt/mutmut-target", str(tmp_path / "rel/dir")]
    )
    assert mutation.child_pythonpath(".", mutation.ROOT) is None  # "." from the root is the root
    assert mutation.child_pythonpath(None, tmp_path) is None
    assert mutation.child_pythonpath(f"{root}{os.pathsep}", tmp_path) is None


def test_rank_rest_is_rank_but_its_other_parts() -> None:
    mutate, tests = mutation.SCOPES["rank-rest"]
    assert tests == ["tests/rank"]
    parts = {m for s in ("rank-oom", "rank-heartbeat", "rank-status") for m in mutation.SCOPES[s][0]}
    every = {f"vramwatch/rank/{p.name}" for p in (ROOT / "vramwatch" / "rank").glob("*.py")}
    assert set(mutate) == every - parts and "vramwatch/rank/sampler.py" in mutate
    assert "rank-rest" in mutation.PARTS


def test_server_is_the_servers_own_modules_without_the_collectors() -> None:
    mutate, tests = mutation.SCOPES["server"]
    every = {f"vramwatch/server/{p.name}" for p in (ROOT / "vramwatch" / "server").glob("*.py")}
    assert set(mutate) == every and "vramwatch/server/http.py" in mutate
    assert not any("collectors" in m for m in mutate)
    assert tests is mutation.SERVER_TESTS and tests[0] == "tests/server"


def test_each_deselected_server_test_exists() -> None:  # a renamed test would silently run again
    for arg in mutation.SERVER_TESTS:
        if arg.startswith("--deselect="):
            path, _, name = arg.removeprefix("--deselect=").partition("::")
            assert f"def {name}(" in (ROOT / path).read_text(), arg


@pytest.mark.parametrize(
    ("name", "mutate", "tests"),
    [
        ("server:http,auth", ["vramwatch/server/http.py", "vramwatch/server/auth.py"], "SERVER_TESTS"),
        ("server:nvml_backend", ["vramwatch/server/nvml_backend.py"], "SERVER_TESTS"),
        (
            "collectors:xid,gpm",
            ["vramwatch/server/collectors/xid.py", "vramwatch/server/collectors/gpm.py"],
            "COLLECTOR_TESTS",
        ),
        ("spool", ["vramwatch/spool/*"], None),
    ],
)
def test_a_part_names_modules_of_its_scopes_directory(name: str, mutate: list[str], tests: str | None) -> None:
    got_mutate, got_tests = mutation.scope_of(name)
    assert got_mutate == mutate
    assert got_tests == (getattr(mutation, tests) if tests else ["tests/spool"])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("server:nope", "no server module 'nope'"),
        ("server:", "no server module '(none given)'"),
        ("server:xid", "no server module 'xid'"),  # a collector is not a server module
        ("collectors:http", "no collectors module 'http'"),
    ],
)
def test_a_part_naming_no_module_of_its_directory_is_refused(name: str, message: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        mutation.scope_of(name)


def test_the_command_line_takes_parts_of_both_scopes_and_refuses_others(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    summary = {"score": 100.0, "killed": 1, "survived": 0, "no_tests": 0, "timeout": 0, "total": 1}
    monkeypatch.setattr(mutation, "run_scope", lambda scope, mutmut, jobs: ran.append(scope) or summary)
    assert mutation.main(["server:auth", "collectors:xid", "server"]) == 0
    assert ran == ["server:auth", "collectors:xid", "server"]
    with pytest.raises(SystemExit):
        mutation.main(["servers:auth"])


def test_the_childrens_environment_runs_one_thread_and_the_copys_code(tmp_path: Path) -> None:
    env = mutation.child_env({"PYTHONPATH": str(mutation.ROOT), "HOME": "/h"}, tmp_path)
    assert "PYTHONPATH" not in env  # the repository root would shadow the mutated copy
    assert env["HOME"] == "/h"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"  # torch's pool does not survive a fork
    assert env["TEST_TOOLS_DIR"] == str(mutation.ROOT / ".cache" / "debian" / "usr" / "bin")
    kept = mutation.child_env({"OMP_NUM_THREADS": "4", "TEST_TOOLS_DIR": "/t"}, tmp_path)
    assert (kept["OMP_NUM_THREADS"], kept["TEST_TOOLS_DIR"]) == ("4", "/t")  # a caller's choice stands
