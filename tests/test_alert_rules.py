"""The shipped Prometheus alert rules: valid (promtool check), proven to fire on the series that should
raise them and not on healthy ones (promtool test rules), wired into the scrape config, and naming only
series the code exports. promtool comes with Debian's prometheus package (scripts/test installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.test_deploy_manifests import exported_metric_names

PROMETHEUS = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: `apt-get install prometheus` (scripts/test does it when run as root)"
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rules_are_valid_and_fire_as_their_unit_tests_say():
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0 and "SUCCESS: 10 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "alerts_test.yml")
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr
    config = promtool("check", "config", "prometheus.yml", cwd=PROMETHEUS.parent)  # loads the rules it names
    assert config.returncode == 0 and "1 rule files found" in config.stdout, config.stdout + config.stderr


def test_every_alert_has_a_unit_test_and_reads_exported_series():
    rules = [r for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t["alert_rule_test"] if a["exp_alerts"]}
    asked = {
        "PdserveKVIntegrityViolation",
        "PdserveKVTransferFailures",
        "PdserveWorkerLost",
        "PdserveNoDecodeWorkers",
        "PdserveKVCacheNearFull",
        "PdserveTTFTSLO",
    }  # integrity, transfers, lost workers, KV full, TTFT SLO
    assert asked <= fired <= {r["alert"] for r in rules}
    used = {m for r in rules for m in re.findall(r"(?:pdserve|vllm):[a-z0-9_]+", r["expr"])}
    assert used <= exported_metric_names(), used - exported_metric_names()
