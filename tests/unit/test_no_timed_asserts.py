"""No test asserts on a wall-clock measurement: on a loaded 2-core machine a measured time
or ratio of times swings several-fold, so such a check fails for reasons the code does not
own (issue 43 item 5). Timings belong in benchmarks/ and BENCHMARKS.md.

The rule, checked with `ast` on every tests/**/*.py: an `assert` fails the scan when it
holds an ordering comparison (<, <=, >, >=) one of whose operands is *measured* while
another operand is anything but 0 or infinity (a measured figure may be checked positive
and finite, never bounded or compared with another measurement). An expression is
measured when it contains

* a call to `time.time`, `time.monotonic`, `time.perf_counter` (or their `_ns` forms)
  that is part of a subtraction (a duration; a timestamp alone is not one);
* a subscript with a key of `MEASURED_KEYS` (what benchmarks and run logs record as
  measured), or an attribute named in `MEASURED_ATTRS`;
* a call of one of `MEASURED_CALLS` (ptdp's calibration timers);

or is a name assigned in the same function from a measured expression.

Predicted figures (`iteration_seconds`, `mfu` of the performance model) are deterministic
and not measured. An assert whose ordering holds by construction on any clock (a total
over steps against the elapsed time that covers them) may say so with `# not a timing:
<why>` on its line."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CLOCKS = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"}
MEASURED_KEYS = {
    "wall_s",
    "elapsed_s",
    "step_time_s",
    "seconds",
    "tokens_per_s",
    "effective_training_time_ratio",
    "split_backward_ratio",
}
MEASURED_ATTRS = {"seconds", "split_backward_ratio", "elapsed"}
MEASURED_CALLS = {
    "split_backward_ratio",
    "time_call",
    "collective_seconds",
    "launch_seconds",
    "gemm_seconds",
    "attention_seconds",
    "stream_seconds",
    "framework_overhead",
    "optimizer_overhead",
    "interleaved_seconds",
    "in_context_seconds",
    "wait_after_compute",
    "ring_sync",
}
MARK = "# not a timing:"


def _is_clock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr in CLOCKS and isinstance(f.value, ast.Name) and f.value.id == "time"
    return isinstance(f, ast.Name) and f.id in CLOCKS - {"time"}


def _is_duration(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Sub)
        and any(_is_clock_call(n) for n in ast.walk(node))
    )


def _is_measured(node: ast.AST, timed_names: set[str]) -> bool:
    for n in ast.walk(node):
        if _is_duration(n) or (isinstance(n, ast.Name) and n.id in timed_names):
            return True
        if isinstance(n, ast.Subscript):
            key = n.slice
            if isinstance(key, ast.Constant) and key.value in MEASURED_KEYS:
                return True
        if isinstance(n, ast.Attribute) and n.attr in MEASURED_ATTRS:
            return True
        if isinstance(n, ast.Call) and _called(n) in MEASURED_CALLS:
            return True
    return False


def _called(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _is_trivial_bound(node: ast.AST) -> bool:
    """0, 0.0, -0, float("inf"), math.inf."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    if isinstance(node, ast.Constant):
        return node.value == 0 and not isinstance(node.value, bool)
    if isinstance(node, ast.Attribute):
        return node.attr == "inf"
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "float"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and str(node.args[0].value).lower() in {"inf", "+inf", "infinity"}
    )


def _timed_names(scope: ast.AST) -> set[str]:
    """Names assigned from a clock call or a measured expression in this scope (repeated
    until no new name turns up: `took = end - start` after `end = time.monotonic()`)."""
    names: set[str] = set()
    assigns = [n for n in ast.walk(scope) if isinstance(n, ast.Assign)]
    while True:
        found = {
            t.id
            for n in assigns
            if _is_clock_call(n.value) or _is_measured(n.value, names)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        if found <= names:
            return names
        names |= found


def timed_asserts(source: str) -> list[int]:
    """Line numbers of the asserts that bound or compare a measured figure."""
    tree, lines = ast.parse(source), source.splitlines()
    found: list[int] = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for scope in [tree, *scopes]:
        names = _timed_names(scope)
        body = scope.body if scope is tree else [scope]
        for stmt in (s for b in body for s in ast.walk(b)):
            if not isinstance(stmt, ast.Assert) or MARK in lines[stmt.lineno - 1]:
                continue
            for cmp in (c for c in ast.walk(stmt.test) if isinstance(c, ast.Compare)):
                if not all(isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in cmp.ops):
                    continue
                operands = [cmp.left, *cmp.comparators]
                measured = [o for o in operands if _is_measured(o, names)]
                if measured and any(
                    not _is_trivial_bound(o) for o in operands if not any(o is m for m in measured)
                ):
                    found.append(stmt.lineno)
                elif len(measured) > 1:
                    found.append(stmt.lineno)
    return sorted(set(found))


def test_no_test_asserts_on_a_measured_time() -> None:
    offenders = {
        str(path.relative_to(TESTS.parent)): lines
        for path in sorted(TESTS.rglob("*.py"))
        if (lines := timed_asserts(path.read_text()))
    }
    assert offenders == {}, f"move these timing checks into benchmarks/: {offenders}"


def test_the_scan_tells_a_timing_from_a_deterministic_check() -> None:
    flagged = """
import time
def f(r, chaos, clean, event):
    start = time.monotonic()
    assert time.monotonic() - start < 30
    took = time.perf_counter() - start
    assert took >= 0.05
    assert chaos["wall_s"] > clean["wall_s"]
    assert 0.5 < r.device.split_backward_ratio < 3.0
    assert 0.045 < event.seconds < 0.15
    ratio = split_backward_ratio(torch.float32, torch.device("cpu"), Timing(0.01, 3))
    assert 0.8 < ratio < 2.0
"""
    assert timed_asserts(flagged) == [5, 7, 8, 9, 10, 12]
    kept = """
import time
def f(r, out, rec):
    assert r["seconds"] > 0 and 0 < r["split_backward_ratio"] < float("inf")
    assert r["tokens_per_s"] == 3 * r["seconds"]
    assert out["iteration_seconds"] > 20 * rec["iteration_seconds"]
    assert rec["fault_time"] <= time.time()
    assert rec["elapsed_s"] >= 2 * rec["step_time_s"]  # not a timing: covers each step
    ratio = split_backward_ratio(torch.float32, torch.device("cpu"), Timing(0.01, 3))
    assert 0 < ratio < float("inf")
"""
    assert timed_asserts(kept) == []
