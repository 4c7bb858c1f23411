"""Cut tests/data/runners-subset.json out of GitHub's REST description, reproducibly.

Run from the repository root: `python scripts/openapi-subset.py` (needs `npm` and the network:
it runs `npm pack @octokit/openapi@23.0.2` in a temporary directory), or
`python scripts/openapi-subset.py --description generated/api.github.com.json` to cut from a
copy you already have. The tarball and the description are checked against the sha256 sums in
tests/data/SOURCE.md before anything is written. The subset keeps the operations of `WANT`
(only the listed methods of each path), every `#/components/...` object they reach,
transitively, and drops octokit's `x-octokit` keys, so what remains is upstream's text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

PACKAGE = "@octokit/openapi"
VERSION = "23.0.2"
TARBALL = f"octokit-openapi-{VERSION}.tgz"
MEMBER = "package/generated/api.github.com.json"
TARBALL_SHA256 = "71a18407dd5e8464f4e0525daf03deabbe65abd9287d6adc7b5d98f516cd0d0c"
DESCRIPTION_SHA256 = "829b4bebb19a53133289f7b0bc819f4f1118115821db2ca9f25e9ee995a7da2a"
OUTPUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "runners-subset.json"
SUBSET_VERSION = "1.4.0"

WANT: dict[str, list[str]] = {
    "/orgs/{org}/actions/runners": ["get"],
    "/orgs/{org}/actions/runners/{runner_id}": ["get", "delete"],
    "/orgs/{org}/actions/runners/{runner_id}/labels": ["get", "post", "put", "delete"],
    "/orgs/{org}/actions/runners/{runner_id}/labels/{name}": ["delete"],
    "/repos/{owner}/{repo}/actions/runners": ["get"],
    "/repos/{owner}/{repo}/actions/runners/{runner_id}": ["get", "delete"],
    "/repos/{owner}/{repo}/actions/runners/{runner_id}/labels": ["get", "post", "put", "delete"],
    "/repos/{owner}/{repo}/actions/runners/{runner_id}/labels/{name}": ["delete"],
    "/repos/{owner}/{repo}/actions/runs": ["get"],
    "/repos/{owner}/{repo}/actions/runs/{run_id}": ["get"],
    "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs": ["get"],
    "/repos/{owner}/{repo}/actions/runs/{run_id}/attempts/{attempt_number}/jobs": ["get"],
    "/repos/{owner}/{repo}/actions/jobs/{job_id}": ["get"],
    "/rate_limit": ["get"],
    # skip-queue authorization: who labelled the PR, and whether they are in the team
    "/repos/{owner}/{repo}/issues/{issue_number}/events": ["get"],
    "/orgs/{org}/teams/{team_slug}/memberships/{username}": ["get"],
    # GitHub App authentication: an installation token, and the installation of an org or repo
    "/app/installations/{installation_id}/access_tokens": ["post"],
    "/orgs/{org}/installation": ["get"],
    "/repos/{owner}/{repo}/installation": ["get"],
    # many repositories: an org scope over every repository the installation sees
    "/orgs/{org}/repos": ["get"],
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_description(workdir: Path) -> bytes:
    """`npm pack` the package into `workdir` and return its description, both sums checked."""
    subprocess.run(
        ["npm", "pack", f"{PACKAGE}@{VERSION}", "--silent"],
        cwd=workdir,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    tarball = (workdir / TARBALL).read_bytes()
    if sha256(tarball) != TARBALL_SHA256:
        sys.exit(f"{TARBALL} sha256 {sha256(tarball)} is not the recorded {TARBALL_SHA256}")
    with tarfile.open(workdir / TARBALL) as archive:
        member = archive.extractfile(MEMBER)
        if member is None:
            sys.exit(f"{TARBALL} has no {MEMBER}")
        return member.read()


def strip_octokit(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip_octokit(v) for k, v in node.items() if k != "x-octokit"}
    if isinstance(node, list):
        return [strip_octokit(v) for v in node]
    return node


def collect_refs(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            out.add(ref)
        for value in node.values():
            collect_refs(value, out)
    elif isinstance(node, list):
        for value in node:
            collect_refs(value, out)


def cut(full: dict[str, Any]) -> dict[str, Any]:
    """The subset document: the WANT operations and every component they reach."""
    paths: dict[str, Any] = {}
    for path, methods in WANT.items():
        item = full["paths"][path]
        kept = {method: item[method] for method in methods}
        for key in ("parameters", "summary", "description", "servers"):
            if key in item:
                kept[key] = item[key]
        paths[path] = kept
    components: dict[str, dict[str, Any]] = {}
    todo: set[str] = set()
    collect_refs(paths, todo)
    seen: set[str] = set()
    while todo:
        ref = todo.pop()
        if ref in seen:
            continue
        seen.add(ref)
        if not ref.startswith("#/components/"):
            sys.exit(f"reference {ref} does not point into components")
        _, _, kind, name = ref.split("/", 3)
        node = full["components"][kind][name]
        components.setdefault(kind, {})[name] = node
        collect_refs(node, todo)
    order = ["schemas", "parameters", "responses", "headers", "examples"]
    used_tags = sorted(
        {
            tag
            for item in paths.values()
            for op in item.values()
            if isinstance(op, dict)
            for tag in op.get("tags", [])
        }
    )
    return {
        "openapi": full["openapi"],
        "info": {
            "version": SUBSET_VERSION,
            "title": "GitHub v3 REST API - runners, workflow jobs, skip-queue and App token subset",
            "description": "Subset of GitHub's REST API OpenAPI description "
            "(github/rest-api-description, descriptions/api.github.com/api.github.com.json). "
            "See SOURCE.md next to this file.",
            "license": {"name": "MIT", "url": "https://spdx.org/licenses/MIT"},
            "x-github-plan": "api.github.com",
        },
        "tags": [tag for tag in full.get("tags", []) if tag["name"] in used_tags],
        "servers": full.get("servers", []),
        "externalDocs": full.get("externalDocs"),
        "paths": paths,
        "components": {k: dict(sorted(components[k].items())) for k in order if k in components},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--description", type=Path, help="a local generated/api.github.com.json (skips npm)"
    )
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    if args.description is not None:
        raw = args.description.read_bytes()
    else:
        with tempfile.TemporaryDirectory(prefix="openapi-subset-") as workdir:
            raw = fetch_description(Path(workdir))
    if sha256(raw) != DESCRIPTION_SHA256:
        sys.exit(f"description sha256 {sha256(raw)} is not the recorded {DESCRIPTION_SHA256}")
    doc = cut(strip_octokit(json.loads(raw)))
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    args.output.write_text(text, encoding="utf-8")
    counts = {kind: len(items) for kind, items in doc["components"].items()}
    print(f"{args.output}: {len(doc['paths'])} paths, {counts}, sha256 {sha256(text.encode())}")


if __name__ == "__main__":
    main()
