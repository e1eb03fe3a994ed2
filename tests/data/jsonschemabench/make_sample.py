"""Draws the committed JSONSchemaBench sample: 100 schemas from each of the ten sets under `data/` of a clone of
the benchmark's repository, seeded, minified, at most 32 KB each (the cap is a bias toward smaller schemas, recorded
in PROVENANCE.md; it matters for Github_ultra only). Run: python make_sample.py GIT_DIR [COMMIT].

Reads the clone with `git` (a bare mirror works) and writes sample.jsonl.gz beside this script: one line per
schema, {"set", "name", "schema"}, sets and names in sorted order."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

SEED = 2026
PER_SET = 100
MAX_BYTES = 32_768
SETS = (
    "Github_trivial", "Github_easy", "Github_medium", "Github_hard", "Github_ultra",
    "Glaiveai2K", "JsonSchemaStore", "Kubernetes", "Snowplow", "WashingtonPost",
)  # fmt: skip


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def main(repo: str, commit: str = "HEAD") -> None:
    rng = random.Random(SEED)
    out = []
    for name in SETS:
        files = sorted(git(repo, "ls-tree", "--name-only", f"{commit}:data/{name}").split())
        rng.shuffle(files)
        picked = []
        for f in files:
            try:
                schema = json.loads(git(repo, "show", f"{commit}:data/{name}/{f}"))
            except ValueError:
                continue
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
            if len(text.encode()) <= MAX_BYTES:
                picked.append({"set": name, "name": f, "schema": schema})
            if len(picked) == PER_SET:
                break
        out += sorted(picked, key=lambda r: r["name"])
    lines = [json.dumps(r, separators=(",", ":"), ensure_ascii=False) for r in out]
    data = ("\n".join(lines) + "\n").encode()
    (Path(__file__).parent / "sample.jsonl.gz").write_bytes(gzip.compress(data, mtime=0))
    print(f"{len(out)} schemas from {commit} ({git(repo, 'rev-parse', commit).strip()})")


if __name__ == "__main__":
    main(*sys.argv[1:])
