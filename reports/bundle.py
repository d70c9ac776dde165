"""The evidence bundle of a certification: ``certification-<UTC time>.tar.gz``.

One file a reviewer can check without re-running anything. Under one top
folder it holds everything the run wrote -- the certificate (Markdown, JSON
and HTML), JUnit, the results file, Allure's results with every attachment (the
chaostoolkit journals, failure-time dumps, evidence) -- plus what it ran
with: ``profile.yaml`` (the effective certification profile), the golden
templates as they were read (``golden/``), ``versions.json`` (Kubernetes,
KubeRay, Kueue, Ray, torch, Python, the suite's commit), and
``MANIFEST.sha256`` (``sha256sum``'s format, one line per file, so
``sha256sum -c`` checks it too).

``verify`` checks the manifest against the files (a file changed, missing or
not listed fails it), then rebuilds the certificate from ``results.json`` and
the platform rows recorded in ``certification.json`` and fails on any
difference from the certificate in the bundle: its data (certification.json)
always, its Markdown and HTML where the verifying suite is the commit that
wrote them (another commit may render them otherwise).
"""
from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import time
import zlib
from pathlib import Path, PurePosixPath
from typing import Any

from core import redaction
from reports import summary as summary_mod

MANIFEST = "MANIFEST.sha256"
VERSIONS = "versions.json"
PROFILE = "profile.yaml"
GOLDEN = "golden"
REPO = Path(__file__).resolve().parents[1]


class BundleError(ValueError):
    """The file is not a bundle this suite can read (not a tar.gz, no manifest, unsafe paths)."""


class DamagedBundle(BundleError):
    """A gzip file whose archive cannot be read to its end: a bundle changed since it was written (a
    byte of the compressed file), which fails verification rather than being bad input."""


def published_template(text: str) -> str:
    """A golden template as the bundle holds it: as read, unless it holds a
    literal credential (a password, token or key field, or an env entry so
    named), which is replaced by ``[REDACTED]``, said in a first comment line.
    Its recorded sha256 is the file's as the platform has it."""
    import yaml

    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return redaction.redact(text)
    cleaned = [redaction.redact_secret_fields(doc) for doc in docs]
    paths = [p for _, found in cleaned for p in found]
    if not paths:
        return redaction.redact(text)
    return (f"# rayproof: literal credentials replaced by {redaction.REDACTED} ({', '.join(paths)}); the sha256 in "
            "the certificate is of the template as the platform has it\n"
            + str(yaml.safe_dump_all([doc for doc, _ in cleaned], sort_keys=False)))


def write(out_dir: Path, *, profile_yaml: str, templates: dict[str, dict[str, str]],
          versions: dict[str, Any]) -> Path:
    """Write the run's profile, golden templates and versions into ``out_dir``,
    then ``out_dir/certification-<time>.tar.gz`` of all of it with its manifest."""
    results = json.loads((out_dir / "results.json").read_text())
    (out_dir / PROFILE).write_text(profile_yaml)
    for key, template in templates.items():
        (out_dir / GOLDEN).mkdir(exist_ok=True)
        (out_dir / GOLDEN / f"{key}.yaml").write_text(published_template(Path(template["file"]).read_text()))
    (out_dir / VERSIONS).write_text(json.dumps(versions, indent=2, sort_keys=True, default=str))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(results.get("finished") or time.time()))
    top = f"certification-{stamp}"
    files = sorted(p for p in out_dir.rglob("*")
                   if p.is_file() and not p.is_symlink() and not p.name.endswith(".tar.gz") and p.name != MANIFEST)
    manifest = "".join(f"{_sha256(p.read_bytes())}  {p.relative_to(out_dir).as_posix()}\n" for p in files)
    (out_dir / MANIFEST).write_text(manifest)
    bundle = out_dir / f"{top}.tar.gz"
    partial = bundle.with_name(bundle.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for path in [*files, out_dir / MANIFEST]:
            tar.add(path, arcname=f"{top}/{path.relative_to(out_dir).as_posix()}", recursive=False)
    partial.replace(bundle)  # a reader never sees half a bundle
    return bundle


def verify(bundle: Path, members: dict[str, bytes] | None = None) -> tuple[list[str], dict[str, Any]]:
    """The problems found (none when the bundle holds what its manifest says and
    its certificate is the one its results make) and the certificate's summary.
    ``members``: the bundle as :func:`read` returned it, where the caller has it."""
    members = read(bundle) if members is None else members
    if MANIFEST not in members:
        raise BundleError(f"{bundle} has no {MANIFEST}; it is not a rayproof evidence bundle")
    problems: list[str] = []
    listed: dict[str, str] = {}
    for number, line in enumerate(members[MANIFEST].decode(errors="replace").splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            problems.append(f"{MANIFEST} line {number} is not '<sha256>  <path>': {line[:120]!r}")
            continue
        listed[name] = digest
    for name, digest in sorted(listed.items()):
        if name not in members:
            problems.append(f"{name} is in the manifest but not in the bundle")
        elif _sha256(members[name]) != digest:
            problems.append(f"{name} does not match its manifest hash (sha256 {_sha256(members[name])}, "
                            f"manifest {digest})")
    problems += [f"{name} is in the bundle but not in the manifest"
                 for name in sorted(members) if name != MANIFEST and name not in listed]
    missing = [name for name in ("results.json", *summary_mod.CERTIFICATE_FILES) if name not in members]
    if missing:
        return problems + [f"the bundle has no {', '.join(missing)}; the certificate cannot be rebuilt"], {}
    try:
        results = json.loads(members["results.json"])
        recorded = json.loads(members["certification.json"])
        rebuilt = summary_mod.build(results, recorded["platform"])
    except (ValueError, KeyError, TypeError) as exc:
        return problems + [f"the certificate cannot be rebuilt from results.json: {exc!r}"], {}
    # The Markdown and HTML are renderings: compared only where this suite made
    # them (another commit may lay them out otherwise); the data always.
    rendered_here = _suite_commit(members) == commit_of(REPO)
    compared = summary_mod.CERTIFICATE_FILES if rendered_here else summary_mod.CERTIFICATE_FILES[:1]
    for name, text in zip(compared, summary_mod.render(rebuilt)):
        found = members[name].decode(errors="replace")
        if found != text:
            problems.append(f"{name} is not the certificate its results.json makes: {_first_difference(found, text)}")
    return problems, rebuilt


def versions(target: dict[str, Any], runner: dict[str, str], repo: Path) -> dict[str, Any]:
    """What a reviewer needs to know ran: the platform's components, the
    runner's Ray, torch and Python, and the suite's own commit."""
    return {"platform": target.get("versions") or {}, "runner": runner, "suite_commit": commit_of(repo)}


def suite_commit(bundle: Path) -> str | None:
    """The suite commit that wrote the bundle (its versions.json)."""
    return _suite_commit(read(bundle))


def _suite_commit(members: dict[str, bytes]) -> str | None:
    try:
        commit = json.loads(members.get(VERSIONS) or b"{}").get("suite_commit")
        return None if commit is None else str(commit)
    except (ValueError, AttributeError):
        return None


def commit_of(repo: Path) -> str:
    try:
        done = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30, check=True)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return done.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


# What a bundle may unpack to; more is not a certification's evidence (a
# few MB) but a decompression bomb (one of 498 KB asked for 1 GB).
MAX_UNPACKED_BYTES = 256 * 2**20


def gunzip_bounded(data: bytes, limit: int) -> bytes:
    """``data`` gunzipped (every member, each checked to its end: CRC and
    length), refusing to produce more than ``limit`` bytes; data that is not
    gzip is returned as it is (tarfile then says what it is not)."""
    if data[:2] != b"\x1f\x8b":
        return data
    out, rest = bytearray(), data
    while rest:
        d = zlib.decompressobj(wbits=31)
        chunk = d.decompress(rest, limit + 1 - len(out))
        out += chunk
        if len(out) > limit or d.unconsumed_tail:
            raise OSError(f"it unpacks to more than {limit // 2**20} MiB, more than any certification's evidence")
        if not d.eof:
            raise EOFError("the gzip stream ends early")
        rest = d.unused_data.lstrip(b"\x00")
    return bytes(out)


def read(bundle: Path) -> dict[str, bytes]:
    """Every regular file of the bundle by its path below the top folder. Links,
    devices, absolute paths and '..' are refused: nothing is extracted."""
    gzipped = False
    try:
        data = bundle.read_bytes()
        gzipped = data[:2] == b"\x1f\x8b"
        # Decompressed whole first: gzip checks its CRC and length only at the
        # stream's end, which tarfile never reads past the archive's last member.
        tar = tarfile.open(fileobj=io.BytesIO(gunzip_bounded(data, MAX_UNPACKED_BYTES)), mode="r:")
    except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
        if gzipped:
            raise DamagedBundle(f"{bundle} is damaged: {exc} (changed since certify wrote it)") from None
        raise BundleError(f"{bundle} is not a readable tar.gz: {exc}") from None
    files: dict[str, bytes] = {}
    tops: set[str] = set()
    try:
        with tar:
            for member in tar.getmembers():
                path = PurePosixPath(member.name)
                if path.is_absolute() or ".." in path.parts or len(path.parts) < 2:
                    raise BundleError(f"{bundle}: member {member.name!r} is not below one top folder")
                if not member.isfile():
                    raise BundleError(f"{bundle}: member {member.name!r} is not a regular file")
                tops.add(path.parts[0])
                handle = tar.extractfile(member)
                files[PurePosixPath(*path.parts[1:]).as_posix()] = handle.read() if handle else b""
    except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:  # a damaged archive, found while reading it
        raise DamagedBundle(f"{bundle} is damaged: {exc} (changed since certify wrote it)") from None
    if len(tops) > 1:
        raise BundleError(f"{bundle} has more than one top folder: {', '.join(sorted(tops))}")
    return files


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file (a bundle, as a reviewer's ``sha256sum`` prints it)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _first_difference(found: str, expected: str) -> str:
    for number, (a, b) in enumerate(zip(io.StringIO(found), io.StringIO(expected)), 1):
        if a != b:
            return f"line {number} reads {a.rstrip()[:160]!r}, the rebuilt one {b.rstrip()[:160]!r}"
    return f"it has {found.count(chr(10)) + 1} lines, the rebuilt one {expected.count(chr(10)) + 1}"
