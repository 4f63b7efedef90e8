"""The wheel as a user gets it: built from a copy of the tree, installed into a fresh virtualenv without
torch (and without grafana-foundation-sdk or bcrypt), and every shipped artefact checked from there.

Offline: the wheel is built with the running interpreter's setuptools (`--no-build-isolation`) and
installed with its pip (`pip --python`, `--no-deps`); the three runtime dependencies come from this
environment's site-packages through a .pth file listing only them, so torch cannot leak in."""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from deploy_files import DEPLOY, K8S, RULES, run

from harness import ROOT, free_port, http_get, parse_metrics, tool, wait_until

pytestmark = pytest.mark.slow

# what the wheel needs at run time, by top-level module (prometheus-client, pyyaml, nvidia-ml-py)
RUNTIME_MODULES = ("prometheus_client", "yaml", "_yaml", "pynvml.py")
SOURCES = ("vramwatch", "deploy", "pyproject.toml", "setup.py", "MANIFEST.in", "LICENSE", "README.md")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(
            ROOT / name, src / name, **({"ignore": ignore} if (ROOT / name).is_dir() else {})
        )
    out = tmp_path_factory.mktemp("dist")
    r = run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        str(src),
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("vramwatch-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("venv")
    r = run(sys.executable, "-m", "venv", "--without-pip", str(d / "env"))
    assert r.returncode == 0, r.stderr
    py = d / "env" / "bin" / "python"
    deps = d / "deps"
    deps.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for name in RUNTIME_MODULES:
        (deps / name).symlink_to(site / name)
    target_site = Path(run(str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (target_site / "vramwatch-test-deps.pth").write_text(f"{deps}\n")
    # without PYTHONPATH: pip would take the checkout on it for an installed vramwatch and skip the wheel
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return d / "env"


def _env() -> dict[str, str]:
    # nothing of the checkout: no PYTHONPATH, and a working directory outside it
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("VRAMWATCH_")}


def vw(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / "vramwatch"), *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=60
    )


def test_the_wheel_carries_every_deploy_file_and_the_license(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = email.message_from_bytes(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
        license_text = z.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))).decode()
    deploy = {
        "vramwatch/_deploy/" + str(p.relative_to(DEPLOY))
        for p in DEPLOY.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    assert deploy and deploy <= names, sorted(deploy - names)
    assert {n for n in names if n.startswith("vramwatch/_deploy/")} == deploy, "a stray file in the package data"
    assert license_text == (ROOT / "LICENSE").read_text() and "Apache License" in license_text
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(c.startswith("Topic :: System :: Monitoring") for c in meta.get_all("Classifier"))
    assert {u.split(",")[0] for u in meta.get_all("Project-URL")} >= {"Homepage", "Source", "Issues"}
    extras = set(meta.get_all("Provides-Extra"))
    assert {"auth", "hf", "lightning", "integrations", "dashboards", "report", "test"} <= extras
    required = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert sorted(r.split(">")[0] for r in required) == ["nvidia-ml-py", "prometheus-client", "pyyaml"]
    assert not any("torch" in r for r in meta.get_all("Requires-Dist"))
    report = [r for r in meta.get_all("Requires-Dist") if 'extra == "report"' in r]
    assert any("vramwatch[dashboards]" in r or "grafana-foundation-sdk" in r for r in report), report
    pythons = {
        c.rsplit(" ", 1)[1] for c in meta.get_all("Classifier") if c.startswith("Programming Language :: Python :: 3.")
    }
    assert {"3.11", "3.12", "3.13"} <= pythons, pythons


def test_installed_without_torch_every_artefact_works(venv, tmp_path):
    py = str(venv / "bin" / "python")
    r = subprocess.run(
        [
            py,
            "-c",
            "import sys, vramwatch, vramwatch.shipped as s; assert 'torch' not in sys.modules; "
            "print(vramwatch.__file__); print(s.root())",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    module, data = r.stdout.split()
    assert str(venv) in module and data == str(Path(module).parent / "_deploy"), "not the installed copy"
    for absent in ("torch", "grafana_foundation_sdk", "bcrypt"):
        r = subprocess.run([py, "-c", f"import {absent}"], cwd=tmp_path, env=_env(), capture_output=True, timeout=60)
        assert r.returncode != 0, f"{absent} is importable in the fresh venv"

    r = vw(venv, "--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "vramwatch 0.1.0", r.stdout + r.stderr

    r = vw(venv, "alerts", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == RULES.read_text(), r.stderr
    r = vw(venv, "alerts", "--format", "prometheusrule", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == (K8S / "prometheusrule.yaml").read_text(), r.stderr

    r = vw(venv, "dashboards", cwd=tmp_path)
    uids = sorted(json.loads(p.read_text())["uid"] for p in (DEPLOY / "grafana" / "dashboards").glob("*.json"))
    assert r.returncode == 0 and sorted(line.split()[0] for line in r.stdout.splitlines()) == uids, r.stderr
    one = DEPLOY / "grafana" / "dashboards" / "vramwatch-training-memory.json"
    r = vw(venv, "dashboards", "--uid", json.loads(one.read_text())["uid"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == one.read_text(), r.stderr
    r = vw(venv, "dashboards", "--write", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    written = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert "kubernetes/dashboards-configmap.yaml" in written and len(written) >= len(uids) + 1
    for rel in written:
        assert (tmp_path / "out" / rel).read_text() == (DEPLOY / rel).read_text(), rel
    r = vw(venv, "dashboards", "--check", str(DEPLOY), cwd=tmp_path)
    assert r.returncode == 2 and "grafana-foundation-sdk" in r.stderr, "rebuilding needs the SDK, and says so"

    r = vw(venv, "serve", "--help", cwd=tmp_path)
    assert r.returncode == 0 and "--port" in r.stdout, r.stderr


def test_installed_deploy_writes_the_chart_the_unit_and_alertmanager_yml(venv, tmp_path):
    """`vramwatch deploy --write DIR` from the installed package data: every deploy file, as in the tree, and a
    chart Helm installs from there (its train.py, a link in the tree, a file here)."""
    out = tmp_path / "out"
    r = vw(venv, "deploy", "--write", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    shipped = {str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    written = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert written == shipped
    for rel in ("helm/vramwatch/Chart.yaml", "systemd/vramwatch.service", "alertmanager/alertmanager.yml"):
        assert rel in written
    for rel in written:
        assert (out / rel).read_bytes() == (DEPLOY / rel).read_bytes(), rel
    assert not (out / "helm/vramwatch/files/train.py").is_symlink()
    r = run(tool("helm"), "lint", "--strict", str(out / "helm" / "vramwatch"))
    assert r.returncode == 0, r.stdout + r.stderr
    # a file the user changed is not overwritten unless asked
    (out / "alertmanager" / "alertmanager.yml").write_text("route: {receiver: mine}\n")
    r = vw(venv, "deploy", "--write", str(out), cwd=tmp_path)
    assert r.returncode == 1 and "alertmanager.yml" in r.stderr and "--force" in r.stderr
    assert (out / "alertmanager" / "alertmanager.yml").read_text() == "route: {receiver: mine}\n"
    r = vw(venv, "deploy", "--write", str(out), "--force", cwd=tmp_path)
    assert (
        r.returncode == 0
        and (out / "alertmanager" / "alertmanager.yml").read_bytes()
        == (DEPLOY / "alertmanager" / "alertmanager.yml").read_bytes()
    )


def test_installed_server_serves_without_torch_or_nvml(venv, tmp_path):
    """`vramwatch serve` from the wheel on this machine (pynvml imports, NVML is absent): it serves, and
    says NVML is absent instead of reporting a failing collector."""
    port = free_port()
    env = _env() | {"VRAMWATCH_SPOOL_DIR": str(tmp_path / "spool"), "VRAMWATCH_PORT": str(port)}
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [str(venv / "bin" / "vramwatch"), "serve"], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:

        def metrics() -> dict | None:
            try:
                code, body = http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)
            except OSError:
                return None
            return parse_metrics(body.decode()) if code == 200 else None

        m = wait_until(metrics, 30, "the installed server's /metrics")
        up = {lab["collector"]: v for lab, v in m["vramwatch_collector_up"]}
        if m.get("gpu_info"):
            pytest.skip("this machine has NVML")
        assert up["nvml"] == 1 and up["xid"] == 1, up
        assert m["vramwatch_nvml_available"] == [({"reason": "library_not_found"}, 0.0)]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def _one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_installed_without_the_extras_every_command_says_what_it_needs(venv, tmp_path):
    """What a plain `pip install` meets: a setting it cannot honour is refused with the extra named, in one
    line; nothing ends in a traceback."""
    cfg = tmp_path / "monitoring.yaml"
    cfg.write_text("memory_warning_ratio: 0.8\n")
    out = tmp_path / "dash"
    r = vw(venv, "dashboards", "--config", str(cfg), "--write", str(out), cwd=tmp_path)
    assert r.returncode == 2 and "grafana-foundation-sdk" in _one_line(r) and "--config" in r.stderr, r.stderr
    assert not out.exists(), "the default dashboards were written although --config asked for others"
    r = vw(venv, "alerts", "--config", str(cfg), cwd=tmp_path)
    assert r.returncode == 0 and "0.8" in r.stdout, r.stderr  # the rules honour it without the SDK

    r = vw(venv, "report", "--prometheus", "http://127.0.0.1:9", "--out", str(tmp_path / "r.html"), cwd=tmp_path)
    line = _one_line(r)
    assert r.returncode == 2 and "grafana-foundation-sdk" in line and "vramwatch[report]" in line, r.stderr

    r = vw(venv, "docs", cwd=tmp_path)  # outside a checkout: nothing to regenerate, nothing written
    assert r.returncode == 2 and "not a vramwatch checkout" in _one_line(r), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["monitoring.yaml"], "docs wrote into a non-checkout"

    head = subprocess.run(  # the reader is gone before the first write (`| head` when it left): a quiet stop
        f"'{venv}/bin/vramwatch' config | true",
        shell=True,
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not head.stderr, head.stderr

    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import vramwatch; vramwatch.start(serve='off'); vramwatch.stop()"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    line = _one_line(r)
    assert r.returncode == 0 and "torch is not installed" in line and "only the heartbeat" in line, r.stderr
