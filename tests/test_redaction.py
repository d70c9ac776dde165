"""Secrets never reach a report: every attached log, evidence value and
failure message passes through the redaction (core/redaction.py)."""
from __future__ import annotations

from core import redaction

SECRET = "5ecret0f7he9cs"  # stands for a local Redis password

FAILING_GCS_CLAUSE = f'''
import pytest
from core import redaction

@pytest.mark.clause("GCS-X")
def test_gcs(evidence, tmp_path):
    """The head MUST come back."""
    password = redaction.register("{SECRET[:5]}" + "{SECRET[5:]}")  # not in this source as one string
    log = tmp_path / "head.log"
    log.write_text("ray start --head --redis-password={{p}} --port=6379\\nGCS connected with {{p}}\\n".format(p=password))
    evidence.attach_file("head log", log)
    evidence.on_failure("pod environment", lambda: "REDIS_PASSWORD=" + "hunter2" + "hunter\\n"
                        + "RAY_REDIS_PASSWORD: '" + "xyzzy" + "-plugh'")
    evidence.record("redis", {{"address": "10.0.0.1:6379", "url": "redis://:" + password + "@10.0.0.1"}})
    assert False, "the GCS at redis://:" + password + "@10.0.0.1 never answered"
'''


def test_no_report_of_a_failed_gcs_clause_holds_the_redis_password(pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["fixtures.plugin"]')
    pytester.mkdir("conformance")
    pytester.path.joinpath("conformance", "test_gcs.py").write_text(FAILING_GCS_CLAUSE)
    out = pytester.path / "out"
    result = pytester.runpytest("conformance", f"--rayproof-results={out / 'results.json'}",
                                f"--junitxml={out / 'junit.xml'}", f"--alluredir={out / 'allure'}")
    result.assert_outcomes(failed=1)
    written = {path: path.read_text(errors="replace") for path in out.rglob("*") if path.is_file()}
    assert {p.name for p in written} >= {"results.json", "junit.xml"}
    assert any(p.parent.name == "allure" for p in written), sorted(written)
    for secret in (SECRET, "hunter2hunter", "xyzzy-plugh"):
        assert secret not in result.stdout.str(), f"{secret} in the terminal report"
        leaked = [str(p) for p, text in written.items() if secret in text]
        assert not leaked, f"{secret} in {leaked}"
    junit = written[out / "junit.xml"]
    assert "--redis-password=[REDACTED]" in junit and "redis://:[REDACTED]@10.0.0.1" in junit, junit[-3000:]


def test_redaction_keeps_what_is_not_a_secret() -> None:
    text = "ray start --redis-password='abc123xyz' --port=6379 requirepass s3cr3tpass and REDIS_PASSWORD=p4ssw0rdx"
    assert redaction.redact(text) == ("ray start --redis-password='[REDACTED]' --port=6379 requirepass [REDACTED] "
                                      "and REDIS_PASSWORD=[REDACTED]")
    assert redaction.redact("the GCS at gcs-redis:6379 answered") == "the GCS at gcs-redis:6379 answered"


def test_secret_fields_are_redacted_by_name_and_nothing_else():
    from core.redaction import REDACTED, redact_secret_fields

    doc = {"redisPassword": "p4ssw0rd", "tokenizer": "gpt2", "auth": {"redisPassword": {"value": "x1"}},
           "env": [{"name": "AWS_SECRET_ACCESS_KEY", "value": "k"}, {"name": "MODEL", "value": "m"},
                   {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "s", "key": "password"}}}]}
    clean, paths = redact_secret_fields(doc)
    assert clean["redisPassword"] == REDACTED and clean["auth"]["redisPassword"]["value"] == REDACTED
    assert clean["tokenizer"] == "gpt2" and clean["env"][1]["value"] == "m" and clean["env"][0]["value"] == REDACTED
    assert clean["env"][2] == doc["env"][2]  # a reference to a Secret holds no secret
    assert sorted(paths) == ["auth.redisPassword.value", "env[0].value", "redisPassword"]
