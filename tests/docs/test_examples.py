"""Every example in README.md and docs/*.md runs as written.

Each ```python block runs in one fresh interpreter (the blocks of a page in order, in
one namespace per page, so a later block may use what an earlier one made); each
```bash / ```sh block runs as a bash script; each ```console block runs its `$ `
commands and checks the output lines it shows (loosely: `...` stands for anything,
spaces are collapsed, and every shown line must appear in that order) and the exit
status, 0 unless a shown line says `(exit status N)`. They run in a
temporary directory holding a copy of `configs/`, with the venv's bin first on PATH,
`HF_HUB_OFFLINE=1` and `TRAINWELL_QUICK=1`, the documented switch that shrinks every run
to a smoke test, so the whole test costs minutes, not hours.

A block that cannot run here (a real ImageNet, a cluster, `make` itself, or a run that
costs minutes even under `TRAINWELL_QUICK`) carries the line `<!-- not run: REASON -->`
right before it; the test lists them (and parses the Python ones). A fence with no
language, or one that neither runs nor is plain data (yaml, json, text), fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "bash", "sh", "console"}
DATA = {"yaml", "json", "text"}
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```([\w-]*)\s*$")


def blocks(page: Path) -> list[dict]:
    """The fenced blocks of a page: language, code, line number, the not-run reason (or None)."""
    out, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        reason = NOT_RUN.search(prev)
        out.append({"lang": lang, "code": "\n".join(lines[start + 1:j]) + "\n", "line": start + 1,
                    "where": f"{page.name}:{start + 1}", "not_run": reason.group(1) if reason else None})
        i = j + 1
    return out


def _env(workdir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERASTUNER_")}
    bindir = str(Path(sys.executable).parent)
    env.update(PATH=bindir + os.pathsep + env.get("PATH", ""), HF_HUB_OFFLINE="1", TRAINWELL_QUICK="1",
               TF_CPP_MIN_LOG_LEVEL="2", MPLBACKEND="Agg", PYTHONUNBUFFERED="1", HOME=str(workdir / "home"))
    return env


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    shutil.copytree(ROOT / "configs", d / "configs")
    (d / "home").mkdir()
    return d


def _run(args, workdir, timeout=600, **kw):
    return subprocess.run(args, cwd=workdir, env=_env(workdir), capture_output=True, text=True, timeout=timeout, **kw)


def test_every_fence_is_runnable_or_marked_and_the_skipped_are_few():
    skipped, bad = [], []
    for page in PAGES:
        for b in blocks(page):
            if b["lang"] not in RUN | DATA:
                bad.append(f"{b['where']}: fence language {b['lang']!r} (use python, bash, console, yaml, json, text)")
            if b["not_run"]:
                skipped.append(f"{b['where']}: {b['not_run']}")
            if b["not_run"] and b["lang"] == "python":
                compile(b["code"], b["where"], "exec")  # not run, but it must at least parse
    print("Examples not run:\n  " + "\n  ".join(skipped))
    assert not bad, "\n".join(bad)
    assert len(skipped) <= 12, f"{len(skipped)} examples are marked 'not run': make them runnable"


_DRIVER = r'''
import os, sys, traceback
pages = {pages!r}
for page, items in pages:
    ns = {{"__name__": "__main__"}}
    for where, code in items:
        print(f"=== {{where}}", flush=True)
        try:
            exec(compile(code, where, "exec"), ns)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED: {{where}}", flush=True)
            sys.exit(1)
'''


@pytest.mark.slow
def test_python_examples(workdir):
    pages = [(p.name, [(b["where"], b["code"]) for b in blocks(p) if b["lang"] == "python" and not b["not_run"]])
             for p in PAGES]
    pages = [p for p in pages if p[1]]
    # Keras fixes its backend at its first import: a page that picks one (docs/backends.md)
    # runs in an interpreter of its own; the others share one (one TensorFlow start-up).
    own = [p for p in pages if any("KERAS_BACKEND" in code for _, code in p[1])]
    for group in [[p for p in pages if p not in own]] + [[p] for p in own]:
        r = _run([sys.executable, "-c", _DRIVER.format(pages=group)], workdir)
        assert r.returncode == 0, f"{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


def console_commands(code: str) -> list[tuple[str, list[str]]]:
    """`[(command, [shown output lines])]` of a console block (`$ ` prompts, `\\` continuations)."""
    out: list[tuple[str, list[str]]] = []
    cont = False
    for line in code.splitlines():
        if cont:
            out[-1] = (out[-1][0] + "\n" + line, out[-1][1])
        elif line.startswith("$ "):
            out.append((line[2:], []))
        elif out and line.strip():
            out[-1][1].append(line)
        cont = line.rstrip().endswith("\\") and bool(out)
    return out


def _pattern(line: str) -> re.Pattern:
    parts = [re.escape(" ".join(p.split())) for p in line.split("...")]
    return re.compile(".*".join(parts))


def matches_loosely(shown: list[str], output: str) -> str | None:
    """None when every shown line appears in `output`, in order; else the first missing line."""
    got = [" ".join(x.split()) for x in output.splitlines()]
    i = 0
    for line in shown:
        pat = _pattern(line)
        while i < len(got) and not pat.search(got[i]):
            i += 1
        if i == len(got):
            return line
        i += 1
    return None


def _shell_blocks():
    return [pytest.param(b, id=b["where"]) for p in PAGES for b in blocks(p)
            if b["lang"] in ("bash", "sh", "console") and not b["not_run"]]


EXIT = re.compile(r"^\(exit status (\d+)\)$")


@pytest.fixture
def docs_bucket(_s3_server, monkeypatch):
    """`s3://bucket` on the local S3 server (tests/conftest.py), named by the standard variables the
    object-store examples read (docs/checkpoint.md), as a user's MinIO would be."""
    import boto3  # comes with moto: only the object-store examples need it

    for k, v in {"AWS_ENDPOINT_URL": _s3_server, "AWS_ACCESS_KEY_ID": "testing-key-id",
                 "AWS_SECRET_ACCESS_KEY": "testing-secret-value", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", endpoint_url=_s3_server, region_name="us-east-1")
    if "bucket" not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket="bucket")


@pytest.mark.slow
@pytest.mark.parametrize("block", _shell_blocks())
def test_shell_examples(block, workdir, request):
    if "s3://" in block["code"]:
        request.getfixturevalue("docs_bucket")
    if block["lang"] != "console":  # a script: every line must succeed
        r = _run(["bash", "-euo", "pipefail", "-c", block["code"]], workdir)
        assert r.returncode == 0, f"{block['where']} exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        return
    for command, shown in console_commands(block["code"]):
        r = _run(["bash", "-o", "pipefail", "-c", command], workdir)
        output = r.stdout + r.stderr
        status = next((int(m.group(1)) for m in map(EXIT.match, shown) if m), 0)  # a shown "(exit status N)"
        shown = [line for line in shown if not EXIT.match(line)]
        assert r.returncode == status, f"{block['where']}: `{command}` exited {r.returncode}:\n{output[-4000:]}"
        missing = matches_loosely(shown, output)
        assert missing is None, f"{block['where']}: `{command}` did not print {missing!r}; it printed:\n{output[-4000:]}"


def test_the_loose_output_match_and_the_parsers(tmp_path):
    assert matches_loosely(["Run directory: ... (new run)", "test_accuracy ..."],
                           "x\nRun directory:  runs/a  (new run)\ny\ntest_accuracy 0.5") is None
    assert matches_loosely(["b", "a"], "a\nb") == "a"  # order counts
    assert console_commands("$ a \\\n  --b\nout\n$ c\n") == [("a \\\n  --b", ["out"]), ("c", [])]
    page = textwrap.dedent("""\
        <!-- not run: needs ImageNet -->
        ```bash
        tfds build imagenet2012
        ```
        ```python
        x = 1
        ```
        """)
    path = tmp_path / "page.md"
    path.write_text(page)
    got = blocks(path)
    assert [(b["lang"], b["not_run"]) for b in got] == [("bash", "needs ImageNet"), ("python", None)]
