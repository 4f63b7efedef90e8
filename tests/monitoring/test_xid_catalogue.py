"""The Xid catalogue in the contract: generated from NVIDIA's catalogue text, every code mapped to a bounded action."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from vramwatch.monitoring import contract, xid_catalogue
from vramwatch.monitoring.config import DEFAULT

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gen_xid_catalogue  # noqa: E402  (the generator lives in scripts/, not in the package)

# the data-center codes the hand-written lists missed (issue 41), and the ones every training job meets
ISSUE_CODES = (110, 136, 143, 144, 145, 146, 147, 148, 149, 150, 154, 155, 156, 158)


def test_every_catalogue_code_maps_to_an_action_of_the_bounded_set():
    assert len(contract.XID_CATALOGUE) >= 150
    for code, (mnemonic, meaning, action) in contract.XID_CATALOGUE.items():
        assert action in contract.XID_ACTIONS, (code, action)
        assert re.fullmatch(r"[a-z][a-z0-9_]*", action), action
        assert mnemonic and meaning, code
    # every action the catalogue uses, and unknown, is in the set; the set holds nothing else
    assert set(contract.XID_ACTIONS) == {a for _, _, a in contract.XID_CATALOGUE.values()} | {xid_catalogue.UNKNOWN}


def test_each_action_alerts_one_way_and_has_advice():
    groups = (
        xid_catalogue.PAGE_ACTIONS,
        xid_catalogue.WARN_ACTIONS,
        (xid_catalogue.SOLO_ACTION,),
        xid_catalogue.SILENT_ACTIONS,
    )
    flat = [a for g in groups for a in g]
    assert len(flat) == len(set(flat)) == len(contract.XID_ACTIONS)
    assert set(xid_catalogue.ADVICE) == set(contract.XID_ACTIONS)
    # the brief's split: a reset, a reboot or support pages; restart_app warns; ignore never alerts
    assert {"reset_gpu", "restart_bm", "contact_support"} <= set(xid_catalogue.PAGE_ACTIONS)
    assert "restart_app" in xid_catalogue.WARN_ACTIONS and xid_catalogue.UNKNOWN in xid_catalogue.WARN_ACTIONS
    assert xid_catalogue.action(45) == xid_catalogue.SOLO_ACTION


@pytest.mark.parametrize(
    "code, action",
    [(13, "restart_app"), (31, "restart_app"), (43, "ignore"), (45, "workflow_xid_45"), (48, "workflow_xid_48")]
    + [(79, "restart_bm"), (94, "restart_app"), (95, "reset_gpu"), (74, "workflow_nvlink_err"), (154, "xid_154")]
    + [(c, "reset_gpu") for c in (110, 136, 143, 155, 156, 158)]
    + [(c, "workflow_nvlink5_err") for c in range(144, 151)],
)
def test_the_codes_the_issue_names_carry_the_catalogue_action(code, action):
    assert contract.XID_CATALOGUE[code][2] == action
    assert xid_catalogue.action(code) == action == xid_catalogue.action(str(code))


def test_a_code_or_label_the_catalogue_lacks_is_unknown():
    assert xid_catalogue.action(185) == xid_catalogue.action("other") == xid_catalogue.action(999) == "unknown"
    assert xid_catalogue.meaning(185) == ""


def test_preinitialised_codes_are_a_short_list_and_the_alert_defaults_follow_their_actions():
    assert len(contract.XID_PREINIT) <= 24 and set(contract.XID_PREINIT) <= set(contract.XID_CATALOGUE)
    page = {x for x in contract.XID_PREINIT if xid_catalogue.action(x) in contract.XID_PAGE_ACTIONS}
    warn = {x for x in contract.XID_PREINIT if xid_catalogue.action(x) in contract.XID_WARN_ACTIONS}
    assert set(DEFAULT.xid_critical) == page and set(DEFAULT.xid_warning) == warn
    assert {79, 48, 95, 119} <= page and {13, 31, 94} <= warn
    assert 45 not in page | warn and 43 not in page | warn  # a lone 45 warns by its own branch; ignore never


def test_the_data_module_is_what_the_generator_makes_of_the_catalogue_text():
    """No network: the TSV beside the script is the catalogue text; the module must be its rendering."""
    header, rows = gen_xid_catalogue.parse(gen_xid_catalogue.TSV.read_text(encoding="utf-8"))
    assert any(xid_catalogue.SOURCE_URL in h for h in header) and any(xid_catalogue.SOURCE_VERSION in h for h in header)
    assert gen_xid_catalogue.OUT.read_text(encoding="utf-8") == gen_xid_catalogue.render(header, rows)
    assert {code: (m, d, a) for code, m, d, a in rows} == contract.XID_CATALOGUE
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_xid_catalogue.py"), "--check"], timeout=60)
    assert r.returncode == 0


@pytest.mark.parametrize(
    "line, error",
    [
        ("13\tX\tY\n13\tX\tY\tRESTART_APP", "4 tab-separated columns"),
        ("13\tX\tY\tRESTART_APP\n13\tX\tY\tIGNORE", "Xid 13 listed twice"),
        ("13\tX\tY\trestart app", "not a resolution bucket"),
    ],
)
def test_the_generator_rejects_a_malformed_catalogue(line, error):
    with pytest.raises(ValueError, match=error):
        gen_xid_catalogue.parse(line)


def test_an_empty_bucket_is_unspecified():
    _, rows = gen_xid_catalogue.parse("# c\ncode\tmnemonic\tdescription\timmediate_action\n171\tU\tD\t")
    assert rows == [(171, "U", "D", "unspecified")]


def test_recovery_actions_follow_nvidia_ml_py():
    for value, name in enumerate(contract.RECOVERY_ACTIONS):
        assert getattr(pynvml, f"NVML_GPU_RECOVERY_ACTION_{name.upper()}") == value
        assert xid_catalogue.recovery_action(value) == name
    assert pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION == 230
    assert set(xid_catalogue.RECOVERY_ADVICE) == set(contract.RECOVERY_ACTIONS)
    with pytest.raises(ValueError, match="unknown GPU recovery action 8"):
        xid_catalogue.recovery_action(8)


def test_the_runbook_lists_each_common_code_with_its_catalogue_action():
    text = (ROOT / "docs" / "runbooks.md").read_text()
    section = text.split("\n## GPUXidError\n", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| (\d+(?:-\d+)?) \| [^|]+ \| ([a-z0-9_]+) \|", section, flags=re.M))
    for code in (*contract.XID_PREINIT, *ISSUE_CODES):
        key = next((k for k in rows if k == str(code) or ("-" in k and _within(code, k))), None)
        assert key is not None, f"Xid {code} missing from the runbook's table"
        assert rows[key] == xid_catalogue.action(code), f"Xid {code}: runbook says {rows[key]}"
    for action in contract.XID_ACTIONS:
        assert f"`{action}`" in section, f"the runbook's action table lacks {action}"


def _within(code: int, span: str) -> bool:
    low, high = (int(x) for x in span.split("-"))
    return low <= code <= high
