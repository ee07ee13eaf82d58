"""Mutation testing of the paged core against its fast tests (no model, no GPU): do the tests catch small,
wrong changes?

Two passes over the modules in ``MODULES``:

1. mutmut (``pip install -e '.[mutation]'``; configured in ``pyproject.toml``, ``[tool.mutmut]``): its
   operators (comparison, arithmetic, ``and``/``or``, ``True``/``False``, +1 numbers, strings, arguments
   and assignments to None, removed unary operators, ...).
2. The operator classes mutmut lacks, by this script: each simple statement of a function deleted (``pass``
   in its place) and each ``min``/``max`` swapped, one at a time, in a scratch copy of the tree.

A mutant is killed when a test fails (or the run times out). Survivors matching ``EQUIVALENT`` (the change
cannot alter any result) are listed with their reason and left out of the score; any other survivor
is a missing test. Prints the score per module and writes ``docs/mutation.md``. Not part of CI (about 10
minutes on 2 cores); run it when the core changes.

Usage: ``python scripts/mutation.py [--skip-mutmut] [--skip-extra] [--jobs 2]``
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Module -> the fast tests that cover it (the extra pass runs only these; mutmut picks per function).
MODULES = {
    "rawpaged/core/block_pool.py": ["tests/core"],
    "rawpaged/core/block_table.py": ["tests/core"],
    "rawpaged/core/prefix_cache.py": ["tests/core"],
    "rawpaged/core/kv_cache_manager.py": ["tests/core"],
    "rawpaged/core/kv_tier.py": ["tests/core"],
    "rawpaged/core/scheduler.py": ["tests/core/test_scheduler.py", "tests/core/test_kv_cache_snapshot.py"],
    "rawpaged/core/sequence.py": ["tests/core"],
    "rawpaged/core/kv_events.py": ["tests/core/test_kv_cache_snapshot.py"],
    "rawpaged/core/kv_cache_snapshot.py": ["tests/core/test_kv_cache_snapshot.py"],
    "rawpaged/sampling_params.py": ["tests/test_sampling_params.py"],
    "rawpaged/model_executor/sampler.py": ["tests/model_executor/test_sampler.py"],
    "rawpaged/engine/beam_search.py": ["tests/engine/test_beam_search.py"],
    "rawpaged/engine/logprobs.py": ["tests/engine/test_logprobs.py", "tests/engine/test_beam_search.py"],
}
#: The modules the 90% bar applies to (the others are reported too).
REQUIRED = ("block_pool", "kv_cache_manager", "scheduler", "sampling_params", "sampler", "beam_search")
TARGET = 0.90

#: Survivors that cannot change any result: (module stem, function, text of the mutated line, reason).
EQUIVALENT = [
    ("block_pool", "take", "popitem(last=None)", "None is falsy like False: the same end of the queue"),
    ("block_pool", "release", 'self._free[block_id] = ""', "the free queue's values are never read"),
    (
        "kv_cache_manager",
        "cache_full_blocks",
        "num_computed_tokens / bs <= len",
        "an early return only: past it the loop hashes no block either",
    ),
    (
        "kv_cache_manager",
        "cache_full_blocks",
        "num_computed_tokens // bs < len",
        "an early return only: at equality the loop below hashes nothing",
    ),
    ("scheduler", "_check_stop", "return None", "falling off the end returns None as well"),
    ("scheduler", "schedule", "budget >= 0", "with no budget left every n is 0: the loop schedules nothing"),
    (
        "sampling_params",
        "__post_init__",
        "self.temperature <= MIN_TEMPERATURE",
        "at exactly MIN_TEMPERATURE it is set to MIN_TEMPERATURE",
    ),
    ("sampler", "log_softmax", "logits.astype(None)", "astype(None) is float64"),
    ("sampler", "sampling_arrays", "], dtype=None)", "a list of Python floats (or none) is float64 by default"),
    ("sampler", "sampling_arrays", "params], )", "a list of Python floats (or none) is float64 by default"),
    ("sampler", "sampling_arrays", "draws], )", "a list of Python floats (or none) is float64 by default"),
    ("beam_search", "step", "num_logprobs: int = 1", "the default is read only together with logprobs"),
    ("beam_search", "step", "astype(None)", "astype(None) is float64"),
    ("beam_search", "step", "np.asarray(cum_logprobs, None)", "Python floats become float64 anyway"),
    ("beam_search", "step", "np.asarray(cum_logprobs, )", "Python floats become float64 anyway"),
    ("beam_search", "step", "reshape(-2)", "NumPy reads any negative size as 'the rest'"),
    ("beam_search", "step", "int(idx / vocab)", "exact in float64 for indices below 2^53"),
    (
        "beam_search",
        "step",
        "keep - 2)[:keep]",
        "NumPy's introselect leaves the next-best candidate right after the kth (not promised by its contract)",
    ),
    ("logprobs", "top_logprobs", 'kind="STABLE"', "NumPy reads the sort kind case-insensitively"),
]


@dataclass
class Mutant:
    module: str  # stem, e.g. "scheduler"
    function: str
    line: str  # the mutated line (after)
    status: str  # killed, timeout, survived, equivalent
    reason: str = ""


@dataclass
class Tally:
    mutants: list = field(default_factory=list)

    def by_module(self) -> dict:
        out: dict[str, dict] = {}
        for m in self.mutants:
            c = out.setdefault(m.module, {"total": 0, "killed": 0, "equivalent": 0, "survived": 0})
            c["total"] += 1
            c["killed" if m.status in ("killed", "timeout") else m.status] += 1
        for c in out.values():
            c["score"] = c["killed"] / max(1, c["total"] - c["equivalent"])
        return out


def _equivalent(module: str, function: str, line: str) -> str | None:
    for mod, fn, text, reason in EQUIVALENT:
        if mod == module and fn == function and text in line:
            return reason
    return None


# ------------------------------------------------------------------------------------------ mutmut
def run_mutmut() -> Tally:
    if shutil.which("mutmut") is None:
        sys.exit("mutmut is not installed: pip install -e '.[mutation]'")
    subprocess.run(["mutmut", "run"], cwd=ROOT, check=False, stdout=subprocess.DEVNULL)
    listing = subprocess.run(["mutmut", "results", "--all", "true"], cwd=ROOT, capture_output=True, text=True).stdout
    tally = Tally()
    for name, status in re.findall(r"^\s*(\S+?): (\w[\w ]*)$", listing, flags=re.M):
        match = re.match(r"rawpaged\.(?:\w+\.)*?(\w+)\.x[ǁ_](?:\w+ǁ)?(\w+?)__mutmut_\d+$", name)
        if not match:
            continue
        module, function = match.groups()
        line = ""
        if status != "killed":
            diff = subprocess.run(["mutmut", "show", name], cwd=ROOT, capture_output=True, text=True).stdout
            added = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
            line = " | ".join(added)
        reason = _equivalent(module, function, line) if status == "survived" else None
        status = {"no tests": "survived"}.get(status, status)
        tally.mutants.append(Mutant(module, function, line, "equivalent" if reason else status, reason or ""))
    return tally


# ------------------------------------------------------------------------------------------ extra operators
_SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return, ast.Raise, ast.Assert, ast.Delete)


def extra_mutants(source: str):
    """``(function, description, mutated source)`` for each statement deletion and ``min``/``max`` swap;
    lines marked ``# pragma: no mutate`` (as for mutmut) are left alone."""
    tree = ast.parse(source)
    lines = source.splitlines()
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for fn in functions:
        for body_owner in ast.walk(fn):
            for attr in ("body", "orelse", "finalbody"):
                body = getattr(body_owner, attr, None)
                if not isinstance(body, list):
                    continue
                for i, stmt in enumerate(body):
                    if not isinstance(stmt, _SIMPLE):
                        continue
                    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                        continue  # a docstring
                    if "pragma: no mutate" in lines[stmt.lineno - 1]:
                        continue
                    body[i] = ast.Pass()
                    yield (
                        fn.name,
                        f"delete line {stmt.lineno}: {ast.get_source_segment(source, stmt)}",
                        ast.unparse(tree),
                    )
                    body[i] = stmt
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
                old = node.func.id
                node.func.id = "max" if old == "min" else "min"
                yield fn.name, f"{old} -> {node.func.id} at line {node.lineno}", ast.unparse(tree)
                node.func.id = old


def _scratch_tree() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="rawpaged-mutation-"))
    for name in ("rawpaged", "tests", "benchmarks", "cuda"):
        shutil.copytree(ROOT / name, tmp / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return tmp


def _kills(tree: Path, module: str, source: str, tests: list, timeout: float) -> str:
    (tree / module).write_text(source)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    return "survived" if r.returncode == 0 else "killed"


def run_extra(jobs: int) -> Tally:
    tally = Tally()
    work = []
    for module, tests in MODULES.items():
        source = (ROOT / module).read_text()
        stem = Path(module).stem
        work += [(module, stem, fn, desc, mutated, tests, source) for fn, desc, mutated in extra_mutants(source)]
    trees = [_scratch_tree() for _ in range(jobs)]
    free = list(trees)

    def run_one(item):
        module, stem, fn, desc, mutated, tests, original = item
        tree = free.pop()
        try:
            status = _kills(tree, module, mutated, tests, timeout=120)
        finally:
            (tree / module).write_text(original)
            free.append(tree)
        reason = _equivalent(stem, fn, desc) if status == "survived" else None
        return Mutant(stem, fn, desc, "equivalent" if reason else status, reason or "")

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        tally.mutants = list(pool.map(run_one, work))
    for t in trees:
        shutil.rmtree(t, ignore_errors=True)
    return tally


# ------------------------------------------------------------------------------------------ report
def _table(tally: Tally) -> list:
    rows = ["| module | mutants | killed | equivalent | survived | score |", "|---|---:|---:|---:|---:|---:|"]
    for module, c in sorted(tally.by_module().items()):
        mark = "" if module not in REQUIRED or c["score"] >= TARGET else " (below 90%)"
        rows.append(f"| {module} | {c['total']} | {c['killed']} | {c['equivalent']} | {c['survived']} | "
                    f"{100 * c['score']:.1f}%{mark} |")  # fmt: skip
    return rows


def _listing(tally: Tally, status: str) -> list:
    return [f"- `{m.module}.{m.function}`: `{m.line}`" + (f": {m.reason}" if m.reason else "")
            for m in tally.mutants if m.status == status]  # fmt: skip


def write_report(passes: dict, seconds: float) -> str:
    lines = [
        "# Testing: mutation scores of the core",
        "",
        "Written by `python scripts/mutation.py` (not run in CI). The fast core tests (no model, no GPU) "
        "against small, wrong changes of the core modules: a mutant is killed when a test fails. "
        "Equivalent mutants (no result can change) are listed with their reason and left out of the score. "
        f"Bar: {100 * TARGET:.0f}% on {', '.join(REQUIRED)}.",
        "",
        f"Last run: {time.strftime('%Y-%m-%d')}, {seconds / 60:.0f} minutes on this machine.",
    ]
    for title, tally in passes.items():
        lines += ["", f"## {title}", "", *_table(tally)]
        equivalent, survived = _listing(tally, "equivalent"), _listing(tally, "survived")
        lines += ["", "Equivalent:", "", *(equivalent or ["- none"])]
        lines += ["", "Surviving (a test is missing):", "", *(survived or ["- none"])]
    lines += ["", "## Fast core tests", "", "```", *sorted({t for ts in MODULES.values() for t in ts}), "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-mutmut", action="store_true")
    ap.add_argument("--skip-extra", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs" / "mutation.md"))
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    passes = {}
    if not args.skip_mutmut:
        passes["mutmut's operators"] = run_mutmut()
    if not args.skip_extra:
        passes["Statement deletion and min/max swaps"] = run_extra(args.jobs)
    for title, tally in passes.items():
        print(f"\n{title}")
        print("\n".join(_table(tally)))
        for m in tally.mutants:
            if m.status == "survived":
                print(f"  survived: {m.module}.{m.function}: {m.line}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(write_report(passes, time.monotonic() - t0))
    print(f"\nwrote {args.out}")
    below = [m for t in passes.values() for m, c in t.by_module().items() if m in REQUIRED and c["score"] < TARGET]
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
