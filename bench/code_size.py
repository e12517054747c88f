"""How big the house is: code lines per folder, long modules and functions, local imports.

Reading-only: no training, a second or two. Prints one JSON object (see `bench/README.md`,
"code_size.py"). A code line is a source line holding a token that is neither a comment
nor part of a module, class or function docstring (blank lines do not count).

Run:
    .venv/bin/python bench/code_size.py                 # callbacks/, recipes/, trainwell/
    .venv/bin/python bench/code_size.py callbacks       # one folder
    .venv/bin/python bench/code_size.py --details       # also every file and long function

Example:
>>> from bench.code_size import code_lines  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import pathlib
import re
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_FOLDERS = ("callbacks", "recipes", "trainwell")
MODULE_LIMIT = 800  # lines of a module, everything counted (#32: "read in one sitting")
FUNCTION_LIMIT = 80  # lines of a function; longer ones need a comment saying why
_SKIP = {"__pycache__"}
# Function-local imports that import time needs carry a comment on (or right above)
# the import line saying so; these words are what such comments use.
_LOCAL_IMPORT_REASON = re.compile(r"import time|lazy|heavy|tensorflow|jax|torch|cycle|optional", re.I)


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(source: str) -> int:
    """The number of code lines in `source` (no comments, docstrings or blank lines).

    Args:
        source: A Python module's text.

    Example:
    >>> code_lines("'''Doc.'''\\n# note\\nx = 1\\n\\ny = 2  # two\\n")
    2
    """
    doc = _docstring_lines(ast.parse(source))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in skip:
            continue
        lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in doc)
    return len(lines)


def _module_report(path: pathlib.Path) -> dict:
    source = path.read_text()
    tree = ast.parse(source)
    text_lines = source.splitlines()
    long_functions, local_imports = [], []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > FUNCTION_LIMIT:
                # A comment saying why it is one piece: within the function's first lines.
                head = text_lines[node.lineno - 1: node.lineno + 12]
                explained = any("one piece" in line and "#" in line for line in head)
                long_functions.append({"name": node.name, "line": node.lineno, "lines": length,
                                       "explained": explained})
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    around = " ".join(text_lines[max(0, inner.lineno - 3): inner.end_lineno])
                    local_imports.append({"line": inner.lineno,
                                          "reason_given": bool(_LOCAL_IMPORT_REASON.search(
                                              around.split("#", 1)[1] if "#" in around else ""))})
    return {"lines": len(text_lines), "code_lines": code_lines(source),
            "long_functions": long_functions, "local_imports": local_imports}


def report(folders: list[str]) -> dict:
    """Code size per folder, with the modules and functions over the house limits.

    Args:
        folders: Folders relative to the repository root.

    Example:
    >>> report(["callbacks"])["folders"]["callbacks"]["code_lines"] > 0  # doctest: +SKIP
    True
    """
    out: dict = {"benchmark": "code_size", "module_limit": MODULE_LIMIT,
                 "function_limit": FUNCTION_LIMIT, "folders": {}, "files": {}}
    for folder in folders:
        files = sorted(p for p in (ROOT / folder).rglob("*.py")
                       if not _SKIP & set(p.parts) and not p.is_symlink()
                       and not any(q.is_symlink() for q in p.relative_to(ROOT).parents
                                   if str(q) != "." and (ROOT / q).is_symlink()))
        totals = {"files": 0, "code_lines": 0, "functions_over_limit": 0,
                  "functions_over_limit_unexplained": 0, "modules_over_limit": [],
                  "local_imports": 0, "local_imports_without_reason": 0}
        for path in files:
            rel = str(path.relative_to(ROOT))
            if (ROOT / rel).resolve() != path.resolve():
                continue
            rep = _module_report(path)
            out["files"][rel] = rep
            totals["files"] += 1
            totals["code_lines"] += rep["code_lines"]
            totals["functions_over_limit"] += len(rep["long_functions"])
            totals["functions_over_limit_unexplained"] += sum(
                not f["explained"] for f in rep["long_functions"])
            totals["local_imports"] += len(rep["local_imports"])
            totals["local_imports_without_reason"] += sum(
                not i["reason_given"] for i in rep["local_imports"])
            if rep["lines"] > MODULE_LIMIT:
                totals["modules_over_limit"].append(f"{rel} ({rep['lines']})")
        out["folders"][folder] = totals
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", default=list(DEFAULT_FOLDERS))
    parser.add_argument("--details", action="store_true", help="every file's figures too")
    args = parser.parse_args(argv)
    rep = report(args.folders)
    if not args.details:
        rep.pop("files")
    json.dump(rep, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
