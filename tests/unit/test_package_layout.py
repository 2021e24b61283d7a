"""The package's shape: no import cycles, collectives only in the communication layer,
each concept in one home. Read from the source with `ast`, so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "ptdp"

COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "gather",
    "gather_object",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
}
"""torch.distributed functions that communicate (what DESIGN calls collectives)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every ptdp module `path` imports, at any depth (lazy and TYPE_CHECKING ones too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    out.add(full)
                elif node.module in modules:
                    out.add(node.module)
    return out


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    names = set(sources)
    return {name: _imports(path, names) - {name} for name, path in sources.items()}


def _cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_graph_is_read() -> None:
    graph = _graph()
    assert "ptdp.rules.layout" in graph["ptdp.perf.simulate.simulator"]
    assert "ptdp.pipeline.actions" in graph["ptdp.pipeline.schedules"]


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    graph = _graph()
    cycles = [c for name in graph if (c := _cycle_from(graph, name))]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle_from(graph, "a") == ["a", "b", "c", "a"]
    assert _cycle_from(graph, "d") is None


PERF_LAYERS = ("cost", "simulate", "plan", "validate")
"""ptdp.perf's parts, each importing only those before it (ptdp/perf/__init__.py)."""


def test_perf_parts_depend_one_way() -> None:
    graph = _graph()
    part = {f"ptdp.perf.{p}": i for i, p in enumerate(PERF_LAYERS)}
    bad = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        for dep in deps
        for src, i in part.items()
        if name.startswith(f"{src}.")
        for dst, j in part.items()
        if dep.startswith(f"{dst}.") and j > i
    )
    assert not bad, "a part of ptdp.perf imports a later one:\n" + "\n".join(bad)
    assert any(d.startswith("ptdp.perf.cost.") for d in graph["ptdp.perf.simulate.simulator"])


def _third_party_imports(path: Path) -> set[str]:
    """Top-level names of the non-ptdp packages `path` imports, at any depth."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out - {"ptdp"}


CONFIG_READS_RULES = {"ptdp.config.reference"}
"""The one module of ptdp.config that imports ptdp.rules: the reference page shows each
number's domain (ptdp.rules.domains) beside its key."""


def test_config_comes_before_rules() -> None:
    """What a run says (ptdp.config) is read by what it may say (ptdp.rules), not the
    other way round; only the generated reference page reads both."""
    graph = _graph()
    assert {n for n in graph if n.startswith("ptdp.config.")} >= {
        "ptdp.config.sections",
        "ptdp.config.enums",
        "ptdp.config.files",
        "ptdp.config.presets",
        "ptdp.config.reference",
    }
    bad = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        if name.startswith("ptdp.config") and name not in CONFIG_READS_RULES
        for dep in deps
        if dep.startswith("ptdp.rules")
    )
    assert not bad, "ptdp.config imports ptdp.rules:\n" + "\n".join(bad)
    assert "ptdp.rules.domains" in graph["ptdp.config.reference"]  # the exception is seen
    assert "ptdp.config.sections" in graph["ptdp.rules.layout"]


def test_every_rule_is_reached_from_validate() -> None:
    """Each topic module of ptdp.rules is imported by ptdp.rules.layout (whose validate() is
    the single entry), so a rule cannot sit in a module that nothing runs."""
    graph = _graph()
    topics = {n for n in graph if n.startswith("ptdp.rules.")} - {"ptdp.rules.layout"}
    reached, todo = set(), ["ptdp.rules.layout"]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in reached:
                reached.add(dep)
                todo.append(dep)
    assert len(topics) >= 9 and not topics - reached, sorted(topics - reached)


@pytest.mark.parametrize("package", ["config", "rules"])
def test_config_and_rules_are_pure_python(package: str) -> None:
    """Both run before torch is needed (`ptdp simulate|plan`, any refusal at launch)."""
    used = {
        name: _third_party_imports(path)
        for name, path in _sources().items()
        if name.startswith(f"ptdp.{package}")
    }
    assert used and not {n: u for n, u in used.items() if "torch" in u}
    assert "torch" in _third_party_imports(ROOT / "parallel" / "comm.py")  # the check sees it


def test_no_top_level_config_or_rule_modules() -> None:
    """The configuration and its rules live in their packages, not beside them at the top."""
    loose = sorted(
        p.name
        for p in ROOT.glob("*.py")
        if p.stem.startswith(("config", "layout", "domains", "presets"))
    )
    assert not loose, f"move {loose} into ptdp/config/ or ptdp/rules/"


def _collective_calls(path: Path) -> list[str]:
    """Calls of `dist.<collective>` / `torch.distributed.<collective>` in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, owner = node.func.attr, node.func.value
            named = ast.unparse(owner)
            if attr in COLLECTIVES and named in ("dist", "torch.distributed"):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {named}.{attr}")
    return found


def test_collectives_only_in_the_communication_layer() -> None:
    calls = [
        c
        for name, p in _sources().items()
        if name != "ptdp.parallel.comm"
        for c in _collective_calls(p)
    ]
    assert not calls, "collectives outside ptdp/parallel/comm.py:\n" + "\n".join(calls)
    assert _collective_calls(ROOT / "parallel" / "comm.py")  # the checker sees real calls


@pytest.mark.parametrize("package", ["model", "convert"])
def test_model_and_convert_do_not_import_train(package: str) -> None:
    graph = _graph()
    bad = {
        (name, dep)
        for name, deps in graph.items()
        if name.startswith(f"ptdp.{package}")
        for dep in deps
        if dep.startswith("ptdp.train")
    }
    assert not bad


def test_cli_is_parsing_and_printing_only() -> None:
    lines = (ROOT / "cli.py").read_text().count("\n")
    assert lines < 440, f"ptdp/cli.py has {lines} lines; move logic to the module that owns it"


def test_parameters_carry_no_ad_hoc_attributes() -> None:
    """Which parameters are tied or sequence-parallel is a typed record, not `hasattr`."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("hasattr", "getattr"):
                args = node.args
                if len(args) >= 2 and isinstance(args[1], ast.Constant):
                    if args[1].value in ("tied_to", "sequence_parallel"):
                        offenders.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not offenders, offenders
