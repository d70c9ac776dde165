"""The evidence bundle: written from a run's reports, verified offline, and
failed by one changed byte or by a certificate its results do not make."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from rayproof import cli
from reports import bundle, summary

RESULTS = {"started": 1796250000.0, "finished": 1796251000.0, "host": "runner-1", "exit_status": 1,
           "catalogue": ["GCS-1", "TRN-1"], "timeout_overrides": {}, "profile_outside_ranges": [],
           "results": [{"nodeid": "conformance/gcs/test_gcs.py::test_head_oom", "clause": "GCS-1", "must": "MUST a",
                        "outcome": "passed", "phase": "call", "duration_s": 300.5,
                        "evidence": {"availability": 0.998}, "message": ""},
                       {"nodeid": "conformance/training/test_recovery.py::test_resume", "clause": "TRN-1",
                        "must": "MUST b", "outcome": "failed", "phase": "call", "duration_s": 120.0,
                        "evidence": {"lost_steps": 7}, "message": "AssertionError: lost 7 steps"}],
           "target": {"versions": {"kubernetes": "v1.35.4", "kuberay": "v1.5.0", "kueue": "v0.17.0"}}}


@pytest.fixture
def run_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A certification's report directory as certify leaves it, and its bundle."""
    out = tmp_path / "certification-run"
    (out / "allure-results").mkdir(parents=True)
    (out / "results.json").write_text(json.dumps(RESULTS, indent=2))
    (out / "junit.xml").write_text("<testsuites/>\n")
    (out / "allure-results" / "a-attachment.txt").write_text('{"title": "chaostoolkit journal"}\n')
    summary.write(out / "results.json", {"runner": "the host that ran the suite", "ray": "2.60.0"}, out)
    template = tmp_path / "rayjob.yaml"
    template.write_text("apiVersion: ray.io/v1\nkind: RayJob\n")
    archive = bundle.write(out, profile_yaml="kueue:\n  queue: team-a\n",
                           templates={"rayJob": {"file": str(template), "sha256": "x"}},
                           versions=bundle.versions(RESULTS["target"], {"ray": "2.60.0"}, tmp_path))
    return out, archive


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive, "r:gz") as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers()}


def _repack(archive: Path, members: dict[str, bytes], target: Path) -> Path:
    with tarfile.open(target, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"certification-x/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return target


def test_bundle_holds_the_reports_profile_templates_versions_and_a_manifest(run_dir):
    out, archive = run_dir
    assert archive.name == "certification-20261202T223640Z.tar.gz" and archive.parent == out
    members = _members(archive)
    assert {"certification.md", "certification.json", "certification.html", "junit.xml", "results.json", "profile.yaml",
            "golden/rayJob.yaml", "versions.json", "allure-results/a-attachment.txt", "MANIFEST.sha256"} == set(members)
    versions = json.loads(members["versions.json"])
    assert versions["platform"]["kuberay"] == "v1.5.0" and versions["runner"] == {"ray": "2.60.0"}
    assert versions["suite_commit"]
    manifest = dict(reversed(line.split("  ", 1)) for line in members["MANIFEST.sha256"].decode().splitlines())
    assert set(manifest) == set(members) - {"MANIFEST.sha256"}
    assert manifest["results.json"] == hashlib.sha256(members["results.json"]).hexdigest()


def test_verify_passes_the_bundle_as_written(run_dir, capsys):
    _, archive = run_dir
    problems, rebuilt = bundle.verify(archive)
    assert problems == [] and rebuilt["verdict"] == "NOT CERTIFIED"
    assert cli.main(["verify", str(archive)]) == 0
    assert "verified" in capsys.readouterr().out


def test_one_changed_byte_fails_verify_naming_the_file(run_dir, tmp_path, capsys):
    _, archive = run_dir
    members = _members(archive)
    junit = bytearray(members["junit.xml"])
    junit[1] ^= 0x01
    members["junit.xml"] = bytes(junit)
    changed = _repack(archive, members, tmp_path / "changed.tar.gz")
    problems, _ = bundle.verify(changed)
    assert len(problems) == 1 and problems[0].startswith("junit.xml does not match its manifest hash"), problems
    assert cli.main(["verify", str(changed)]) == cli.VERIFY_FAILED_EXIT
    assert "does NOT verify" in capsys.readouterr().out


def test_one_changed_byte_of_the_archive_itself_fails_verify(run_dir, tmp_path, capsys):
    _, archive = run_dir
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the compressed stream: gzip's CRC or deflate notices
    changed = tmp_path / "changed.tar.gz"
    changed.write_bytes(bytes(data))
    with pytest.raises(bundle.DamagedBundle):
        bundle.verify(changed)
    assert cli.main(["verify", str(changed)]) == cli.VERIFY_FAILED_EXIT
    captured = capsys.readouterr()
    assert "does NOT verify" in captured.out and "damaged" in captured.err
    not_gzip = tmp_path / "notes.tar.gz"
    not_gzip.write_text("not an archive\n")
    assert cli.main(["verify", str(not_gzip)]) == cli.BAD_INPUT_EXIT


def test_a_certificate_its_results_do_not_make_fails_even_with_a_matching_manifest(run_dir, tmp_path):
    _, archive = run_dir
    members = _members(archive)
    certificate = json.loads(members["certification.json"])
    certificate["verdict"] = "CERTIFIED"  # a forged verdict, its manifest line recomputed to match
    members["certification.json"] = json.dumps(certificate, indent=2).encode()
    members["MANIFEST.sha256"] = "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n"
                                         for name, data in members.items() if name != "MANIFEST.sha256").encode()
    problems, _ = bundle.verify(_repack(archive, members, tmp_path / "forged.tar.gz"))
    assert problems == [problems[0]] and problems[0].startswith(
        "certification.json is not the certificate its results.json makes"), problems
    assert '"verdict": "CERTIFIED"' in problems[0]


def test_files_added_or_removed_after_the_manifest_fail_verify(run_dir, tmp_path):
    _, archive = run_dir
    members = _members(archive)
    del members["profile.yaml"]
    members["extra.txt"] = b"slipped in\n"
    problems, _ = bundle.verify(_repack(archive, members, tmp_path / "moved.tar.gz"))
    assert problems == ["profile.yaml is in the manifest but not in the bundle",
                        "extra.txt is in the bundle but not in the manifest"], problems


def test_verify_refuses_what_is_not_a_bundle(tmp_path, capsys):
    not_tar = tmp_path / "x.tar.gz"
    not_tar.write_bytes(b"plain text")
    assert cli.main(["verify", str(not_tar)]) == cli.BAD_INPUT_EXIT
    assert "is not a readable tar.gz" in capsys.readouterr().err
    escaping = tmp_path / "escape.tar.gz"
    with tarfile.open(escaping, "w:gz") as tar:
        info = tarfile.TarInfo("../../etc/passwd")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(bundle.BundleError, match="not below one top folder"):
        bundle.verify(escaping)
    assert cli.main(["verify", str(tmp_path / "missing.tar.gz")]) == cli.BAD_INPUT_EXIT


def test_the_rendered_certificate_is_compared_where_this_suite_wrote_it(run_dir, tmp_path, capsys):
    out, archive = run_dir
    members = _members(archive)
    members["certification.html"] = members["certification.html"].replace(b"NOT CERTIFIED", b"CERTIFIED")

    def forged(commit: str, name: str) -> Path:
        members["versions.json"] = json.dumps({"suite_commit": commit}).encode()
        members["MANIFEST.sha256"] = "".join(f"{hashlib.sha256(data).hexdigest()}  {n}\n"
                                             for n, data in members.items() if n != "MANIFEST.sha256").encode()
        return _repack(archive, members, tmp_path / name)

    here = bundle.commit_of(bundle.REPO)
    problems, _ = bundle.verify(forged(here, "here.tar.gz"))
    assert len(problems) == 1 and problems[0].startswith("certification.html is not the certificate"), problems
    elsewhere = forged("0" * 40, "elsewhere.tar.gz")
    assert bundle.verify(elsewhere)[0] == [], "another commit's rendering is not judged by this one's"
    assert cli.main(["verify", str(elsewhere)]) == 0
    assert f"rendered by suite commit {'0' * 40}, not this checkout's: compared its data" in capsys.readouterr().out


def test_verify_caps_what_it_unpacks(run_dir, tmp_path, monkeypatch, capsys):
    """A small file that unpacks to more than any evidence is refused
    without unpacking it all (a 498 KB file once asked for 1 GB)."""
    import gzip

    bomb = tmp_path / "bomb.tar.gz"
    bomb.write_bytes(gzip.compress(bytes(4 * 2**20)))  # 4 MiB of zeros in ~4 KB
    monkeypatch.setattr(bundle, "MAX_UNPACKED_BYTES", 2**20)
    with pytest.raises(bundle.DamagedBundle, match="unpacks to more than 1 MiB"):
        bundle.verify(bomb)
    assert cli.main(["verify", str(bomb)]) == cli.VERIFY_FAILED_EXIT
    assert "unpacks to more than" in capsys.readouterr().err
    _, archive = run_dir  # a real bundle is well within the cap, and a second gzip member still counts
    assert bundle.verify(archive)[0] == []
    assert bundle.gunzip_bounded(gzip.compress(b"ab") + gzip.compress(b"cd"), 10) == b"abcd"
    with pytest.raises(EOFError):
        bundle.gunzip_bounded(gzip.compress(b"abcdef" * 100)[:-12], 10**6)


def test_a_golden_templates_literal_password_is_not_shipped(tmp_path):
    """A template holding a literal Redis password (or a token in an env
    entry) goes into the bundle with those values redacted; references to
    Secrets stay as they are."""
    template = ("apiVersion: ray.io/v1\nkind: RayCluster\nspec:\n  gcsFaultToleranceOptions:\n"
                "    redisAddress: gcs-redis:6379\n    redisPassword: {value: hunter2-literal}\n"
                "  headGroupSpec:\n    template:\n      spec:\n        containers:\n        - name: ray-head\n"
                "          env:\n          - {name: HF_TOKEN, value: hf_abcdef123456}\n"
                "          - {name: RAY_USAGE_STATS_ENABLED, value: '0'}\n"
                "          - name: REDIS_PASSWORD\n            valueFrom: {secretKeyRef: {name: gcs-redis, key: password}}\n")
    published = bundle.published_template(template)
    assert "hunter2-literal" not in published and "hf_abcdef123456" not in published, published
    assert published.startswith("# rayproof: literal credentials replaced")
    assert "secretKeyRef" in published and "RAY_USAGE_STATS_ENABLED" in published and "'0'" in published
    plain = "apiVersion: ray.io/v1\nkind: RayJob\n"
    assert bundle.published_template(plain) == plain


def test_a_forged_bundle_verifies_alone_but_not_against_its_signer(run_dir, tmp_path, capsys):
    """The issue's forgery: the platform rows edited, the certificate rebuilt
    from them and the manifest recomputed. The bundle alone still verifies;
    its signed statement (certify --sign-key) no longer names it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from reports import attestation

    _, archive = run_dir
    key = ed25519.Ed25519PrivateKey.generate()
    (tmp_path / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    (tmp_path / "k.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    _, made = bundle.verify(archive)
    attestation.sign(archive, tmp_path / "k.pem", made)
    assert cli.main(["verify", str(archive), "--key", str(tmp_path / "k.pub")]) == 0
    assert "signed by the holder of" in capsys.readouterr().out

    members = _members(archive)
    certificate = json.loads(members["certification.json"])
    certificate["platform"]["ray"] = "9.9.9"  # a platform row edited, the certificate rebuilt from it
    members["certification.json"] = json.dumps(certificate, indent=2).encode()
    members["MANIFEST.sha256"] = "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n"
                                         for name, data in members.items() if name != "MANIFEST.sha256").encode()
    forged = _repack(archive, members, tmp_path / archive.name)
    attestation.envelope_path(forged).write_bytes(attestation.envelope_path(archive).read_bytes())
    assert cli.main(["verify", str(forged)]) == 0, "the certificate is rebuilt from the rows it records"
    capsys.readouterr()
    assert cli.main(["verify", str(forged), "--key", str(tmp_path / "k.pub")]) == cli.VERIFY_FAILED_EXIT
    captured = capsys.readouterr()
    assert "does NOT verify" in captured.out
